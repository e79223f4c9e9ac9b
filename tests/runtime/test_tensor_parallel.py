"""Tensor parallelism (runtime/parallel): shards hold exactly their slice of each weight format;
TP=2 (two gloo processes on CPU) gives the logits and greedy tokens of TP=1 on both bundled
models for BF16, INT4 (RTN, AWQ gemm layout), FP8 block and compressed-tensors (mixed FP8 / INT4)
artifacts; bad sizes are refused.

Tolerances (float32 engine): BF16 and INT4 logits agree to 1e-4 (measured ~1e-5: the partial
sums of row-parallel layers add in another order). FP8 block is W8A8: activations are re-quantized
to FP8 before each FP8 linear, so a 1e-7 reduction-order difference can flip an FP8 rounding and
move a logit by ~0.1-0.5 (the TP=1 dsq-tiny-qwen2 FP8 artifact moves 0.47 under 1e-7 relative
noise on its attention outputs); FP8 logits are held to 1.0 end to end, and each FP8 shard is
held to 1e-5 on identical inputs by the layer tests.
"""
from __future__ import annotations

import os

import pytest
import torch

from dsquant.errors import ConfigError
from dsquant.formats.awq_gemm import dequantize_awq, to_awq_tensors
from dsquant.formats.compressed_tensors import pack_quantized_tensors
from dsquant.formats.fp8_block import dequantize_fp8_block, fp8_activation_roundtrip, quantize_fp8_block
from dsquant.formats.gptq import dequantize_gptq, pack_gptq_qweight, to_gptq_tensors, unpack_gptq_qweight
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.layers.compressed_tensors import CTFloat8Method, CTPackedInt4Method
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod
from dsquant.runtime.parallel import linear as tp_linear
from dsquant.runtime.parallel.linear import COLUMN, ROW, ActQuantDenseMethod, Part, RowShardFP8Method, shard_linear
from dsquant.runtime.parallel.state import ParallelState

from conftest import DictReader

P = "model.layers.0.mlp.down_proj"


def checkpoint(scheme: str, n: int, k: int, group: int = 128, act_order: bool = False, seed: int = 0,
               symmetric: bool = False, strategy: str = "block", dynamic: bool = True):
    """-> (tensors of module P in `scheme`, the dense [N, K] weight they encode, the method)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1 * 10 ** (torch.rand(n, 1, generator=g) * 2 - 1)  # rows' scales vary
    if scheme == "dense":
        return {f"{P}.weight": w, f"{P}.bias": torch.randn(n, generator=g)}, w, DenseMethod()
    if scheme == "fp8":
        fp8, sinv = quantize_fp8_block(w)
        return ({f"{P}.weight": fp8, f"{P}.weight_scale_inv": sinv}, dequantize_fp8_block(fp8, sinv),
                FP8BlockMethod())
    if scheme == "ct_fp8":
        if strategy == "block":
            fp8, scale = quantize_fp8_block(w)
        else:
            amax = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
            scale = amax / 448
            fp8 = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
        return _ct_dense({f"{P}.weight": fp8, f"{P}.weight_scale": scale},
                         CTFloat8Method(strategy=strategy, dynamic_activations=dynamic))
    q, s, z = quantize_int_groupwise(w, group)
    if scheme == "ct_int4":
        if symmetric:
            z = torch.full_like(z, 8)  # the codes kept: an encoding, not a fit
        tensors = pack_quantized_tensors(q, s.bfloat16(), z)
        if symmetric:
            del tensors["weight_zero_point"]
        return _ct_dense({f"{P}.{a}": t for a, t in tensors.items()},
                         CTPackedInt4Method(group_size=group, symmetric=symmetric))
    if scheme == "awq":
        qw, qz, sc = to_awq_tensors(q, s, z)
        return ({f"{P}.qweight": qw, f"{P}.qzeros": qz, f"{P}.scales": sc},
                dequantize_awq(qw, qz, sc, group), AWQMethod(group_size=group))
    qw, qz, sc, g_idx = to_gptq_tensors(q, s, z, group)
    if act_order:  # the same codes, channels visited in a random order: g_idx no longer plain
        perm = torch.randperm(k, generator=g)
        qw = pack_gptq_qweight(unpack_gptq_qweight(qw)[perm])
        g_idx = g_idx[perm]
    return ({f"{P}.qweight": qw, f"{P}.qzeros": qz, f"{P}.scales": sc, f"{P}.g_idx": g_idx},
            dequantize_gptq(qw, qz, sc, g_idx), GPTQMethod(group_size=group))


def _ct_dense(tensors, method):
    """(tensors, the weight the method decodes from them, method) for a compressed-tensors layer."""
    return tensors, checkpoint_dense(tensors, method), method


def load_shard(tensors, method, n, k, kind, rank, world=2, bias=False):
    """Shard a fresh meta QuantLinear for `rank` and fill it from the rules, as the loader would."""
    reader = DictReader(tensors)
    layer = QuantLinear(method, P, k, n, bias)
    total = n if kind == COLUMN else k
    dense = {f"{P}.weight": None}

    def dense_weight(key):  # models.loader.WeightSource.dense_weight over the full checkpoint
        return dense[key]

    dense[f"{P}.weight"] = checkpoint_dense(tensors, method)
    parts = [Part.of(total, r, world) for r in range(world)]
    rules, hidden = shard_linear(layer, kind, parts, ParallelState(rank, world), reader, dense_weight)
    for name, meta in list(layer._parameters.items()):
        key = f"{P}.{name}"
        t = rules[key]() if key in rules else reader.get(key)
        assert tuple(t.shape) == tuple(meta.shape), key
        layer._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    return layer, hidden


def checkpoint_dense(tensors, method):
    if f"{P}.weight" in tensors and tensors[f"{P}.weight"].dtype.is_floating_point and method.name == "dense":
        return tensors[f"{P}.weight"]
    if method.name == "fp8_block":
        return dequantize_fp8_block(tensors[f"{P}.weight"], tensors[f"{P}.weight_scale_inv"])
    if method.name.startswith("ct_"):
        layer = QuantLinear(method, P, 1, 1, False)
        for name, t in tensors.items():
            setattr(layer, name.rpartition(".")[2], torch.nn.Parameter(t, requires_grad=False))
        return method.dequantized_weight(layer, torch.float32)
    if method.name == "awq":
        return dequantize_awq(tensors[f"{P}.qweight"], tensors[f"{P}.qzeros"], tensors[f"{P}.scales"],
                                      method.group_size)
    return dequantize_gptq(*(tensors[f"{P}.{a}"] for a in ("qweight", "qzeros", "scales", "g_idx")))


# scheme, N, K, kind, kwargs, the method each rank's shard must keep (None: same as the checkpoint's)
CASES = [
    ("dense", 256, 128, COLUMN, {}, None),
    ("dense", 128, 256, ROW, {}, None),
    ("awq", 256, 256, COLUMN, {}, None),
    ("awq", 256, 256, ROW, {}, None),  # K 128 per rank: whole groups
    ("awq", 256, 128, ROW, {}, None),  # K 64 per rank inside one 128-group: re-grouped to 64
    ("awq", 24, 128, COLUMN, {}, "dense"),  # 12 columns per rank: not whole int32 packs
    ("gptq", 256, 256, COLUMN, {}, None),
    ("gptq", 256, 128, ROW, {}, None),  # plain g_idx: re-grouped
    ("gptq", 256, 256, ROW, {"act_order": True}, "dense"),
    ("fp8", 128, 256, COLUMN, {}, None),  # 64 rows per rank inside one 128-block
    ("fp8", 256, 512, ROW, {}, None),
    ("fp8", 256, 128, ROW, {}, None),  # 64 channels per rank: activation groups span ranks
    ("fp8", 384, 128, COLUMN, {}, "dense"),  # rank 1's rows [192, 384) straddle blocks 1 and 2: both dense
    ("ct_int4", 256, 256, COLUMN, {}, None),
    ("ct_int4", 256, 256, COLUMN, {"symmetric": True}, None),
    ("ct_int4", 256, 256, ROW, {}, None),  # K 128 per rank: whole groups
    ("ct_int4", 256, 128, ROW, {"symmetric": True}, None),  # K 64 per rank inside one 128-group: re-grouped
    ("ct_int4", 24, 128, COLUMN, {}, "dense"),  # 12 rows per rank: not whole zero-point packs
    ("ct_fp8", 128, 256, COLUMN, {}, None),  # 64 rows per rank inside one 128-block
    ("ct_fp8", 256, 512, ROW, {}, None),
    ("ct_fp8", 256, 128, ROW, {}, "fp8_block"),  # W8A8, 64 channels a rank: RowShardFP8Method
    ("ct_fp8", 256, 200, ROW, {"strategy": "channel"}, "dense"),  # W8A8 per-row scales, groups span ranks
    ("ct_fp8", 256, 128, ROW, {"dynamic": False}, None),  # weight-only: the same split keeps its layout
    ("ct_fp8", 384, 128, COLUMN, {"strategy": "channel"}, None),  # per-row scales split anywhere
    ("ct_fp8", 256, 200, ROW, {"strategy": "channel", "dynamic": False}, None),
    ("ct_fp8", 256, 200, ROW, {"strategy": "tensor", "dynamic": False}, None),
]


@pytest.mark.parametrize("scheme,n,k,kind,kw,expect", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[3]}" for c in CASES])
def test_each_rank_holds_exactly_its_slice_of_the_weight(scheme, n, k, kind, kw, expect):
    tensors, w, method = checkpoint(scheme, n, k, **kw)
    for rank in range(2):
        layer, hidden = load_shard(tensors, method, n, k, kind, rank)
        part = Part.of(n if kind == COLUMN else k, rank, 2)
        want = w[part.slice] if kind == COLUMN else w[:, part.slice]
        assert layer.method.name == (expect or method.name)
        got = layer.method.dequantized_weight(layer, torch.float32)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
        if expect == "fp8_block":  # a compressed-tensors W8A8 row split off the groups: fp8_block's row shard
            assert isinstance(layer.method, RowShardFP8Method) and f"{P}.weight_scale" in hidden
        if expect == "dense":  # the packed tensors are not read again under their own names
            assert hidden and all(key in tensors for key in hidden)
            # a W8A8 layer loaded dense still quantizes its activations
            assert isinstance(layer.method, ActQuantDenseMethod) == (scheme in ("fp8", "ct_fp8"))


def test_row_parallel_bias_stays_on_rank_0_and_partial_outputs_sum_to_the_full_layer():
    tensors, w, method = checkpoint("dense", 96, 128)
    x = torch.randn(5, 128)
    parts = []
    for rank in range(2):
        layer, _ = load_shard(tensors, DenseMethod(), 96, 128, ROW, rank, bias=True)
        parts.append(layer(x[:, Part.of(128, rank, 2).slice]))
    torch.testing.assert_close(parts[0] + parts[1], x @ w.t() + tensors[f"{P}.bias"], rtol=1e-5, atol=1e-5)


def test_awq_regrouped_shard_keeps_a_kernel_group_size():
    tensors, _, method = checkpoint("awq", 256, 128)
    layer, _ = load_shard(tensors, method, 256, 128, ROW, 1)
    assert layer.method.group_size == 64 and layer.scales.shape == (1, 256)


def test_fp8_activation_groups_split_across_ranks_quantize_like_the_unsplit_layer(monkeypatch):
    """The W8A8 activation quantization of a K split inside 128-channel groups uses the amax of
    the whole group (all-reduced), so the ranks' inputs are the unsplit layer's, bit for bit."""
    x = torch.randn(7, 320) * torch.linspace(0.1, 3, 320)
    parts = [Part(0, 96), Part(96, 320)]
    seen = []
    monkeypatch.setattr(tp_linear, "all_reduce_max", lambda t, state: seen.append(t.clone()) or t)
    for part in parts:
        tp_linear.sharded_activation_roundtrip(x[:, part.slice], part.start, 320, None, 128)
    both = torch.maximum(*seen)
    monkeypatch.setattr(tp_linear, "all_reduce_max", lambda t, state: t.copy_(both))
    got = torch.cat([tp_linear.sharded_activation_roundtrip(x[:, p.slice], p.start, 320, None, 128)
                     for p in parts], dim=-1)
    assert torch.equal(got, fp8_activation_roundtrip(x))
    tensors, _, method = checkpoint("fp8", 256, 128)
    layer, _ = load_shard(tensors, method, 256, 128, ROW, 1)
    assert isinstance(layer.method, RowShardFP8Method) and layer.method.k_start == 64


# ---------------------------------------------------------------- TP=2 processes against TP=1
MODELS = ("dsq-tiny-v3", "dsq-tiny-qwen2")
# "ct": compressed-tensors (FP8 block attention and shared experts, AWQ INT4 routed experts / dense MLP)
RECIPES = {"bf16": None, "int4": "rtn-w4g128", "fp8": "fp8-block", "ct": "mixed-fp8attn-w4experts"}
TOLERANCE = {"bf16": 1e-4, "int4": 1e-4, "fp8": 1.0, "ct": 1.0}
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 12], [8, 8, 200, 3000, 4], list(range(20, 50))]
MEASURED: dict = {}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(model, scheme) -> directory: the bundled BF16 checkpoints and their INT4 / FP8 artifacts."""
    from dsquant.assets import bundled_model_path
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize

    root, out = tmp_path_factory.mktemp("tp_artifacts"), {}
    for model in MODELS:
        for scheme, recipe in RECIPES.items():
            base = bundled_model_path(model)
            out[model, scheme] = base if recipe is None else run_quantize(
                QuantizeArgs(str(base), recipe, str(root / f"{model}-{scheme}"), n_samples=2, seqlen=32)).out_dir
    return out



def greedy_with_logits(path, tp: int, monkeypatch, reader_factory=None):
    """Greedy tokens per prompt and every step's sampled logits [S, vocab] (rank 0's, gathered)."""
    from dsquant.runtime.engine import model_runner
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
    from dsquant.runtime.engine.sequence import SamplingParams

    steps, sample = [], model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda logits, t, g, p=None, **kw: (
        steps.append(logits.clone()), sample(logits, t, g, p, **kw))[1])
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, tensor_parallel_size=tp,
                                          max_num_seqs=4, max_model_len=128), reader_factory=reader_factory)
    try:
        order = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for p in PROMPTS]
        tokens = {}
        while engine.has_unfinished():
            tokens.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    finally:
        engine.close()
        monkeypatch.setattr(model_runner, "sample", sample)
    return [tokens[r] for r in order], steps


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", list(RECIPES))
@pytest.mark.parametrize("model", MODELS)
def test_tp2_gives_the_logits_and_greedy_tokens_of_tp1(model, scheme, artifacts, one_thread, monkeypatch):
    import multiprocessing

    tokens1, logits1 = greedy_with_logits(artifacts[model, scheme], 1, monkeypatch)
    tokens2, logits2 = greedy_with_logits(artifacts[model, scheme], 2, monkeypatch)
    assert not multiprocessing.active_children()  # the worker was stopped and joined
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) and logits1[0].shape[-1] == 8192
    diff = max((a - b).abs().max().item() for a, b in zip(logits1, logits2))
    MEASURED[model, scheme] = diff
    print(f"\n{model} {scheme}: max |logit TP=2 - TP=1| = {diff:.3g}")
    assert diff <= TOLERANCE[scheme]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_tensor_parallel_random_reader_equals_tp1(scheme, tmp_path, one_thread, monkeypatch):
    """A random-weight model (bench.random_model) served at TP=2 through a reader_factory: every
    rank draws the same tensors on its own and keeps its slice, so logits and greedy tokens equal
    TP=1's (how bench engine measures models that exist only as random draws, e.g. DeepSeek-V2's
    236B shape, which fits no single GPU)."""
    from dsquant.bench.random_model import V2_LITE, RandomReaderSpec, make_config_dir

    tiny = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=4096, rope_scaling=None)
    path = make_config_dir(tmp_path / scheme, V2_LITE, scheme, **tiny)
    factory = RandomReaderSpec(path, seed=3, std=0.05)
    tokens1, logits1 = greedy_with_logits(path, 1, monkeypatch, factory)
    tokens2, logits2 = greedy_with_logits(path, 2, monkeypatch, factory)
    assert tokens2 == tokens1 and len(logits2) == len(logits1)
    diff = max((a - b).abs().max().item() for a, b in zip(logits1, logits2))
    scale = max(a.abs().max().item() for a in logits1)
    assert diff <= 1e-3 * scale, (diff, scale)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_stops_its_workers_when_start_up_fails(monkeypatch, one_thread):
    import multiprocessing

    import torch.distributed as dist

    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    def boom(self, device, max_model_len):
        raise RuntimeError("KV cache allocation failed")

    monkeypatch.setattr(LLMEngine, "_allocate_kv_cache", boom)
    with pytest.raises(RuntimeError, match="KV cache allocation failed"):
        LLMEngine("dsquant/assets/models/dsq-tiny-qwen2", EngineConfig(device="cpu", tensor_parallel_size=2))
    assert not multiprocessing.active_children() and not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_cli_with_two_processes_prints_the_text_of_one():
    """The real entry point (`python -m dsquant`, which spawned workers re-import)."""
    import subprocess
    import sys

    def generate(*extra):
        args = ["generate", "dsq-tiny-qwen2", "--prompt", "The river", "--max-tokens", "6", "--device", "cpu"]
        return subprocess.run([sys.executable, "-m", "dsquant", *args, *extra], capture_output=True, text=True,
                              timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})

    one, two = generate(), generate("--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr
    assert two.stdout.strip() and two.stdout == one.stdout


# ---------------------------------------------------------------- refused sizes
def test_sizes_that_do_not_split_the_model_are_refused_naming_the_flag():
    from dsquant.assets import bundled_model_path
    from dsquant.config import load_config
    from dsquant.runtime.parallel.model import check_tensor_parallel

    v3, qwen = (load_config(bundled_model_path(m)) for m in MODELS)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide num_attention_heads 4"):
        check_tensor_parallel(v3, 3, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4 does not divide num_key_value_heads 2"):
        check_tensor_parallel(qwen, 4, torch.device("cpu"))
    v3.num_attention_heads = 32
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 32 does not divide n_routed_experts 16"):
        check_tensor_parallel(v3, 32, torch.device("cpu"))
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match=r"--tensor-parallel-size 64 exceeds the \d+ CUDA GPUs present"):
            check_tensor_parallel(qwen, 64, torch.device("cuda"))
    check_tensor_parallel(v3, 2, torch.device("cpu"))  # 2 divides everything


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_a_size_that_does_not_divide_the_heads(command, capsys):
    from dsquant.cli import main

    if command == "serve":
        pytest.importorskip("fastapi")
    args = [command, "dsq-tiny-v3", "--device", "cpu", "--tensor-parallel-size", "3"]
    args += ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert "error: --tensor-parallel-size 3 does not divide num_attention_heads 4" in capsys.readouterr().err


@pytest.mark.parametrize("name,params_b,int4_gb", [("v2", 235.7, 124.1), ("v3", 671.0, 352.0)])
def test_large_random_shapes_are_deepseeks_and_split_over_two_ranks(name, params_b, int4_gb, tmp_path):
    """bench engine --model v2 / v3: the random models have DeepSeek-V2's 236B and V3's 671B
    parameters (the meta layout, nothing drawn), INT4 g128 weights that fit no single 141 GB GPU
    for V3 (and not an 80 GB one for V2), and tensor parallelism accepts two ranks for both."""
    import math

    from dsquant.bench.random_model import SHAPES, RandomReaderSpec, make_config_dir
    from dsquant.config import load_config
    from dsquant.runtime.parallel.model import check_tensor_parallel

    bf16 = RandomReaderSpec(make_config_dir(tmp_path / "bf16", SHAPES[name], "bf16"))("cpu")
    assert sum(math.prod(s) for s, _ in bf16.layout.values()) / 1e9 == pytest.approx(params_b, rel=0.01)
    int4_dir = make_config_dir(tmp_path / "int4", SHAPES[name], "int4")
    assert RandomReaderSpec(int4_dir)("cpu").total_bytes() / 1e9 == pytest.approx(int4_gb, rel=0.02)
    check_tensor_parallel(load_config(int4_dir), 2, torch.device("cpu"))
