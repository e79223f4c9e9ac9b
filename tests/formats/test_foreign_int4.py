"""Other tools' INT4 checkpoints are read right, or refused with a named error, never decoded wrong.

Checkpoints are built from the bundled dsq-tiny-qwen2 with the project's own pack functions at
group 64 (not the default 128), then labelled the way each tool does: dsquant / transformers in
config.json's quantization_config, AutoAWQ in quant_config.json, AutoGPTQ / GPTQModel in
quantize_config.json, GPTQ zero points stored v1 (z - 1) or v2 (z). The same grid stored any of
these ways must give the same logits through the serving loader (and the same greedy tokens
through the engine).
"""
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsquant.assets import bundled_model_path
from dsquant.cli import main
from dsquant.errors import CheckpointError, ConfigError
from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.gptq import dequantize_gptq, to_gptq_tensors
from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise
from dsquant.models import load_model
from dsquant.models.layers import Backends
from dsquant.runtime.loader import load_runtime_model

G = 64
AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False,
            "checkpoint_format": "gptq"}
AUTOAWQ = {"zero_point": True, "q_group_size": G, "w_bit": 4, "version": "GEMM"}
AUTOGPTQ = {"bits": 4, "group_size": G, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
            "sym": False, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None}
IDS = torch.tensor([[5, 17, 300, 41, 8, 1200, 77, 9, 64, 3]])


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and t.ndim == 2


@pytest.fixture(scope="module")
def grids():
    """The tiny model's tensors with each Linear on a group-64 grid: name -> (codes, scales, zeros)."""
    src = bundled_model_path("dsq-tiny-qwen2")
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for name, t in state.items():
        if not _is_linear(name, t):
            continue
        w = t.float()
        q, s, z = quantize_int_groupwise(w, G)
        z = z.clamp(min=1)  # GPTQ v1 cannot store zero point 0: clamp and re-round (as calibrate does)
        n, k = w.shape
        q = (torch.round(w.reshape(n, k // G, G) / s[..., None]) + z[..., None]).clamp(0, 15)
        out[name] = (q.to(torch.int32).reshape(n, k), s, z)
    return src, state, cfg, out


def write(tmp_path, grids, name: str, fmt: str, config_q: dict | None, side: tuple[str, dict] | None = None,
          edit=None):
    """A checkpoint dir: `fmt` "awq" | "gptq" | "gptq_v2" tensors, labelled by config_q and/or a side file."""
    src, state, cfg, codes = grids
    tensors = {}
    for key, t in state.items():
        if key not in codes:
            tensors[key] = t
            continue
        mod = key[: -len(".weight")]
        q, s, z = codes[key]
        if fmt == "awq":
            qw, qz, sc = to_awq_tensors(q, s, z)
            tensors.update({f"{mod}.qweight": qw, f"{mod}.qzeros": qz, f"{mod}.scales": sc})
        else:
            qw, qz, sc, gi = to_gptq_tensors(q, s, z, G, v2=fmt == "gptq_v2")
            tensors.update({f"{mod}.qweight": qw, f"{mod}.qzeros": qz, f"{mod}.scales": sc, f"{mod}.g_idx": gi})
    if edit is not None:
        edit(tensors)
    d = tmp_path / name
    d.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": config_q} if config_q else {})}))
    if side:
        (d / side[0]).write_text(json.dumps(side[1]))
    return d


def logits(path):
    model = load_runtime_model(path, Backends(), dtype=torch.float32)
    with torch.no_grad():
        return model(IDS), model.linear_methods


def test_autoawq_quant_config_json_g64_equals_the_dsquant_label(tmp_path, grids):
    ours = write(tmp_path, grids, "ours", "awq", AWQ_CFG)
    theirs = write(tmp_path, grids, "autoawq", "awq", None, ("quant_config.json", AUTOAWQ))
    a, methods = logits(ours)
    b, theirs_methods = logits(theirs)
    assert torch.equal(a, b)
    assert theirs_methods.get("awq") == 42 and set(theirs_methods) == {"awq", "dense"}
    ref = load_model(theirs, dtype=torch.float32)  # the reference loader reads the side file too
    with torch.no_grad():
        assert torch.allclose(ref(IDS), b, atol=1e-4, rtol=1e-4)

    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
    from dsquant.runtime.engine.sequence import SamplingParams

    def greedy(path):
        eng = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=64,
                                           max_model_len=64))
        rid = eng.add_request([5, 17, 300, 41], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        return done[rid]

    assert greedy(ours) == greedy(theirs)


def test_awq_g64_without_any_config_is_refused_not_served_as_g128(tmp_path, grids):
    bare = write(tmp_path, grids, "bare", "awq", None)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.\S+\.qzeros' has "
                                              r"shape \(4, \d+\), expected \(2, \d+\)"):
        logits(bare)
    with pytest.raises(CheckpointError, match="qzeros"):
        load_model(bare, dtype=torch.float32)


def test_autogptq_quantize_config_json_and_gptq_v2_equal_v1(tmp_path, grids):
    v1, _ = logits(write(tmp_path, grids, "v1", "gptq", GPTQ_CFG))
    autogptq, m = logits(write(tmp_path, grids, "autogptq", "gptq", None, ("quantize_config.json", AUTOGPTQ)))
    v2_side, _ = logits(write(tmp_path, grids, "v2side", "gptq_v2", None,
                              ("quantize_config.json", {**AUTOGPTQ, "checkpoint_format": "gptq_v2"})))
    v2_cfg, _ = logits(write(tmp_path, grids, "v2cfg", "gptq_v2", {**GPTQ_CFG, "checkpoint_format": "gptq_v2"}))
    awq, _ = logits(write(tmp_path, grids, "awq", "awq", AWQ_CFG))
    assert m.get("gptq") == 42
    assert torch.equal(v1, autogptq) and torch.equal(v1, v2_side) and torch.equal(v1, v2_cfg)
    assert torch.allclose(v1, awq, atol=1e-4, rtol=1e-4)  # one grid, two formats
    # the same v2 tensors read as v1 are one step off: the test can tell the two apart
    wrong, _ = logits(write(tmp_path, grids, "v2asv1", "gptq_v2", GPTQ_CFG))
    assert (wrong - v1).abs().max() > 1e-2


def test_gptq_v2_repack_for_the_kernels_matches_dequantize():
    from dsquant.runtime.kernels.gemm.w4a16_repack import dequantize_w4a16, repack_gptq

    w = torch.randn(32, 128)
    q, s, z = quantize_int_groupwise(w, 32)  # zero points may be 0: v2 stores them
    qw, qz, sc, gi = to_gptq_tensors(q, s, z, 32, dtype=torch.float32, v2=True)
    dense = dequantize_gptq(qw, qz, sc, gi, v2=True)
    assert torch.allclose(dense, dequantize_int_groupwise(q, s, z, 32))
    assert torch.allclose(dequantize_w4a16(repack_gptq(qw, qz, sc, gi, v2=True)), dense)


def test_wrong_shapes_and_bad_configs_give_named_errors(tmp_path, grids):
    key = "model.layers.2.mlp.down_proj.scales"

    def cut(tensors):
        tensors[key] = tensors[key][:-1]

    bad = write(tmp_path, grids, "cut", "awq", None, ("quant_config.json", AUTOAWQ), edit=cut)
    with pytest.raises(CheckpointError) as e:
        logits(bad)
    msg = str(e.value)
    assert str(bad / "model.safetensors") in msg and repr(key) in msg
    assert "has shape (11, 256), expected (12, 256)" in msg and "group_size 64 from quant_config.json" in msg

    def shuffle(tensors):  # a g_idx that is not a grouping of K (group 0 gets 2 * G channels)
        tensors["model.layers.1.self_attn.o_proj.g_idx"] = torch.zeros(256, dtype=torch.int32).index_fill(
            0, torch.arange(128, 256), 2)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.o_proj\.g_idx' puts 128 input "
                                              r"channels in group 0"):
        logits(write(tmp_path, grids, "gidx", "gptq", GPTQ_CFG, edit=shuffle))

    with pytest.raises(CheckpointError, match=r"group_size 96 \(from config.json\) does not divide in_features 256"):
        logits(write(tmp_path, grids, "g96", "awq", {**AWQ_CFG, "group_size": 96}))
    with pytest.raises(ConfigError, match=r"config\.json and .*quant_config\.json disagree"):
        logits(write(tmp_path, grids, "both", "awq", AWQ_CFG, ("quant_config.json", {**AUTOAWQ, "q_group_size": 128})))
    with pytest.raises(ConfigError, match=r"quantize_config\.json: GPTQ checkpoint_format 'marlin' is not supported"):
        logits(write(tmp_path, grids, "marlin", "gptq", None,
                     ("quantize_config.json", {**AUTOGPTQ, "checkpoint_format": "marlin"})))
    with pytest.raises(ConfigError, match=r"quantize_config\.json: gptq bits 8 is not supported"):
        logits(write(tmp_path, grids, "bits8", "gptq", None, ("quantize_config.json", {**AUTOGPTQ, "bits": 8})))


def test_inspect_describes_side_file_configs(tmp_path, grids, capsys):
    awq = write(tmp_path, grids, "autoawq", "awq", None, ("quant_config.json", AUTOAWQ))
    v2 = write(tmp_path, grids, "v2", "gptq_v2", None,
               ("quantize_config.json", {**AUTOGPTQ, "checkpoint_format": "gptq_v2", "desc_act": True}))
    for path, line in ((awq, "awq 4-bit, group 64, asymmetric (zero point), AutoAWQ gemm (from quant_config.json)"),
                       (v2, "gptq 4-bit, group 64, asymmetric (zero point), GPTQ v2, act-order (desc_act) "
                            "(from quantize_config.json)")):
        with pytest.raises(SystemExit) as e:
            main(["inspect", str(path)])
        out = capsys.readouterr().out
        assert e.value.code == 0 and line in out and "quantization none" not in out
    with pytest.raises(SystemExit):
        main(["inspect", str(awq), "--json"])
    info = json.loads(capsys.readouterr().out)["quantization"]
    assert info == {"method": "awq", "source": "quant_config.json", "bits": 4, "group_size": 64, "zero_point": True,
                    "sym": False, "desc_act": False, "format": "gemm"}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_shards_get_a_plain_file_mode(tmp_path, umask):
    from dsquant.export.writer import ArtifactWriter

    old = os.umask(umask)
    try:
        w = ArtifactWriter(tmp_path / "out", num_layers=1, run_key={"k": 1}, force=False)
        name = w.write_shard(0, {"a": torch.zeros(4)})
        (w.partial / "plain.txt").write_text("x")
        mode = stat.S_IMODE((w.partial / name).stat().st_mode)
        assert mode == 0o666 & ~umask == stat.S_IMODE((w.partial / "plain.txt").stat().st_mode)
    finally:
        os.umask(old)


def test_random_checkpoint_shards_get_a_plain_file_mode(tmp_path):
    """bench.random_model's BF16 checkpoints are read by other users' servers too."""
    import json

    from dsquant.assets import bundled_model_path
    from dsquant.bench.random_model import write_random_checkpoint

    cfg = json.loads((bundled_model_path("dsq-tiny-qwen2") / "config.json").read_text())
    old = os.umask(0o022)
    try:
        out = write_random_checkpoint(tmp_path / "ckpt", cfg)
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in out.glob("*.safetensors")}
    assert modes == {0o644}, modes
