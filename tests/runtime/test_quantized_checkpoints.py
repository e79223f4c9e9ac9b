"""Quantized checkpoints load through the runtime's methods and give the same greedy tokens as a
dense checkpoint holding the weights they encode; a shard that disagrees with dsquant.json is refused."""
import copy
import hashlib
import json
import shutil
import zlib

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file

from dsquant.errors import CheckpointError
from dsquant.formats import fp8_block
from dsquant.formats.awq_gemm import dequantize_awq, to_awq_tensors
from dsquant.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsquant.formats.gptq import dequantize_gptq, pack_gptq_qweight, pack_gptq_qzeros
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

from conftest import random_prompts

G = 32


def is_linear(name: str, t: torch.Tensor) -> bool:
    return (name.endswith(".weight") and t.ndim == 2 and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))


def encode(scheme: str, name: str, w: torch.Tensor, seed: int):
    """-> (tensors to store for module `name`, the dense [N, K] weight they encode)."""
    mod = name[: -len(".weight")]
    if scheme == "awq":
        q, s, z = quantize_int_groupwise(w, G)
        qw, qz, sc = to_awq_tensors(q, s, z)
        return ({f"{mod}.qweight": qw, f"{mod}.qzeros": qz, f"{mod}.scales": sc},
                dequantize_awq(qw, qz, sc, G))
    if scheme.startswith("gptq"):  # act-order: groups follow a random visiting order of the input channels
        k = w.shape[1]  # gptq-plain: no act-order, g_idx the identity's groups
        # gate_proj and up_proj share the order, as GPTQ's act-order gives them (one input, one Hessian)
        seed = zlib.crc32(mod.replace("gate_proj", "up_proj").encode()) + w.shape[1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if scheme == "gptq" else torch.arange(k)
        inv = torch.argsort(perm)
        q, s, z = quantize_int_groupwise(w[:, perm], G)
        g_idx = (inv // G).to(torch.int32)
        qw, qz = pack_gptq_qweight(q[:, inv].t()), pack_gptq_qzeros(z.t())
        sc = s.t().contiguous().half()
        return ({f"{mod}.qweight": qw, f"{mod}.qzeros": qz, f"{mod}.scales": sc, f"{mod}.g_idx": g_idx},
                dequantize_gptq(qw, qz, sc, g_idx))
    if scheme in ("fp8", "ct-fp8") or (scheme in ("ct", "ct-ao") and ".self_attn." in name):
        fp8, sinv = quantize_fp8_block(w)
        key = "weight_scale" if scheme.startswith("ct") else "weight_scale_inv"
        return {f"{mod}.weight": fp8, f"{mod}.{key}": sinv}, dequantize_fp8_block(fp8, sinv)
    # compressed-tensors pack-quantized int4; ct-ao: actorder "group" (weight_g_idx), gate and up sharing it
    k = w.shape[1]
    seed = zlib.crc32(mod.replace("gate_proj", "up_proj").encode()) + k
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if scheme == "ct-ao" else torch.arange(k)
    inv = torch.argsort(perm)
    q, s, z = quantize_int_groupwise(w[:, perm], G)  # groups are runs of perm
    q = q[:, inv]  # stored in the input channels' order, each with its group in weight_g_idx
    s = s.bfloat16()
    g_idx = (inv // G).long()
    tensors = {f"{mod}.weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), f"{mod}.weight_scale": s,
               f"{mod}.weight_zero_point": pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0),
               f"{mod}.weight_shape": torch.tensor(list(w.shape))}
    if scheme == "ct-ao":
        tensors[f"{mod}.weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, (q - z[:, g_idx]).float() * s.float()[:, g_idx]


QCONFIG = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": True, "sym": False},
    "gptq-plain": {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "ct": {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
           "config_groups": {
               "group_0": {"targets": [r"re:^model\.layers\.\d+\.self_attn\..*$"], "format": "float-quantized",
                           "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                                       "block_structure": [128, 128]}},
               "group_1": {"targets": [r"re:^model\.layers\.\d+\.mlp\..*$"], "format": "pack-quantized",
                           "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                       "group_size": G}}}},
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {
                   "targets": ["Linear"],
                   "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                               "block_structure": [128, 128]},
                   "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                         "group_size": 128, "dynamic": True}}}},
}
# compressed-tensors' actorder "group": the "ct" artifact's INT4 group with weight_g_idx
QCONFIG["ct-ao"] = copy.deepcopy(QCONFIG["ct"])
QCONFIG["ct-ao"]["config_groups"]["group_1"]["weights"]["actorder"] = "group"


def write_pair(src, tmp_path, scheme: str):
    """Quantized checkpoint + dense checkpoint of the same (dequantized) weights."""
    state = load_file(src / "model.safetensors")
    quant, dense = {}, {}
    for i, (name, t) in enumerate(sorted(state.items())):
        if is_linear(name, t):
            stored, w = encode(scheme, name, t.float(), i)
            quant.update(stored)
            dense[name] = w.float().contiguous()
        else:
            quant[name] = dense[name] = t
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for kind, tensors, qcfg in (("quant", quant, QCONFIG[scheme]), ("dense", dense, None)):
        d = tmp_path / kind
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qcfg} if qcfg else {})}))
        out[kind] = d
    return out["quant"], out["dense"]


def greedy(path, prompts):
    eng = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=64,
                                       max_model_len=128))
    methods = dict(eng.model.linear_methods)
    ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return [done[i] for i in ids], methods


@pytest.mark.parametrize("scheme,family,expected", [
    ("awq", "deepseek_v2", {"awq"}), ("gptq", "llama", {"gptq"}), ("fp8", "deepseek_v3", {"fp8_block"}),
    ("ct", "deepseek_v2", {"ct_fp8", "ct_int4"})])
def test_quantized_checkpoint_matches_its_dense_twin(scheme, family, expected, tiny_models, tmp_path,
                                                    monkeypatch):
    if scheme == "fp8":  # W8A8: compare the weights alone (test_quant_methods covers the activations)
        monkeypatch.setattr(fp8_block, "fp8_activation_roundtrip",
                            lambda x, group=128, dtype=None: x.to(dtype or x.dtype))
    _, src = tiny_models[family]
    quant, dense = write_pair(src, tmp_path, scheme)
    prompts = random_prompts(2, [9, 14], seed=8)
    q_tokens, methods = greedy(quant, prompts)
    d_tokens, _ = greedy(dense, prompts)
    assert q_tokens == d_tokens
    assert set(methods) - {"dense"} == expected
    assert methods["dense"] == 1  # lm_head only


def test_manifest_checksum_mismatch_is_refused(tiny_models, tmp_path):
    _, src = tiny_models["qwen2"]
    art = tmp_path / "artifact"
    shutil.copytree(src, art)
    shard = art / "model.safetensors"
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    (art / "dsquant.json").write_text(json.dumps({"shards": {"model.safetensors": digest}}))
    greedy(art, [[1, 2, 3]])  # loads while the checksum agrees
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # flip one bit in the last tensor's data
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        greedy(art, [[1, 2, 3]])
