"""A DeepSeek-V3 native FP8 checkpoint (e4m3 weights + weight_scale_inv per 128x128 block).

Written by the test from a random float model. With dims that leave partial edge blocks
(160 = 128 + 32, 288 = 2 x 128 + 32) dsquant's load must equal the float weights within FP8
rounding. transformers 5.17's CPU dequantization derives the block size as rows // scale_rows,
which is wrong for a partial edge block after a full one, so the comparison with transformers'
dequantizing load uses dims that are each a multiple of 128 or a single block.
"""
import json

import torch
import transformers
from safetensors.torch import load_file, save_file

from dsquant.formats.fp8_block import fp8_block_shape, quantize_fp8_block
from dsquant.models import load_model

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}


def is_fp8_target(name: str, t: torch.Tensor) -> bool:
    return (t.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))


EDGE_BLOCKS = dict(hidden_size=160, intermediate_size=288, moe_intermediate_size=160,
                   q_lora_rank=144, kv_lora_rank=96, qk_nope_head_dim=32, v_head_dim=32)
WHOLE_BLOCKS = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                    q_lora_rank=128, kv_lora_rank=112, qk_nope_head_dim=16, v_head_dim=16)


def write_fp8_checkpoint(root, dims: dict):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        qk_rope_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, **dims)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    float_dir = root / "float"
    model.save_pretrained(float_dir)
    dense = load_file(float_dir / "model.safetensors")
    tensors = {}
    for name, t in dense.items():
        if is_fp8_target(name, t):
            q, s = quantize_fp8_block(t)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
        else:
            tensors[name] = t
    fp8_dir = root / "fp8"
    fp8_dir.mkdir()
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, dense, tensors


def test_fp8_load_equals_float_within_rounding(tmp_path):
    fp8_dir, dense, tensors = write_fp8_checkpoint(tmp_path, EDGE_BLOCKS)
    ours = load_model(fp8_dir, dtype=torch.float32)
    params = dict(ours.named_parameters())
    checked = 0
    for name, w in dense.items():
        if not is_fp8_target(name, w):
            assert torch.equal(params[name], w), name
            continue
        scale = tensors[name[: -len("weight")] + "weight_scale_inv"]
        assert scale.shape == fp8_block_shape(*w.shape)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus subnormal steps near zero
        step = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        bound = w.abs() * 2 ** -4 + step * 2 ** -9
        assert ((params[name] - w).abs() <= bound + 1e-7).all(), name
        assert not torch.equal(params[name], w), f"{name} was not quantized"
        checked += 1
    assert checked >= 20


def test_fp8_load_equals_transformers_dequantizing_load(tmp_path):
    fp8_dir, _, _ = write_fp8_checkpoint(tmp_path, WHOLE_BLOCKS)
    ours = load_model(fp8_dir, dtype=torch.float32)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    ref_params = ref.state_dict()
    for name, p in ours.named_parameters():
        if ".experts." in name:
            continue  # transformers fuses experts into 3D tensors; covered by the logits below
        assert torch.allclose(p, ref_params[name].to(torch.float32), atol=1e-6, rtol=0), name
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
