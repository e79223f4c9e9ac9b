"""Random-weight checkpoints for benchmarks: DeepSeek-V2-Lite's shapes without its 31 GB download.

`RandomCheckpointReader` stands where a `CheckpointReader` does (keys, shape, get, ...) and makes
each tensor on demand on the target device, so `load_runtime_model` and `LLMEngine` load a
15.7B-parameter model "from" it in BF16, FP8 block or INT4 without writing it to disk. Every
weight comes from one seeded normal draw per tensor name (std 0.02, norms 1), so the three
schemes are the same model: FP8 is `quantize_fp8_block` of the BF16 weight (DeepSeek-V3 layout),
INT4 its round-to-nearest AWQ g128 (AutoAWQ "gemm" tensors); config.json states them through
the formats' dataclasses (Fp8BlockConfig, AwqConfig), as quantize's export does.

`write_random_checkpoint` saves the BF16 form as sharded safetensors (one shard per decoder
layer, an index), for the commands that read a directory (quantize, validate).

`random_hf_model` builds the other kind: a tiny random model in transformers itself, the oracle
that tests and scripts compare dsquant's loaders and engine with.
"""
from __future__ import annotations

import json
import math
import shutil
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsquant.config import load_config
from dsquant.formats import AwqConfig, Fp8BlockConfig, parse_quantization_config
from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.int_grid import quantize_int_groupwise

# DeepSeek-V2-Lite's config.json (27 layers, 15.7B parameters, 64 routed experts top-6, 2 shared).
V2_LITE: dict = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
    num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False,
    scoring_func="softmax", hidden_act="silu", max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16")

# DeepSeek-V2's config.json (60 layers, 236B parameters, 160 routed experts top-6 in 8 groups of which 3 are
# searched, 2 shared, MLA with q LoRA, 128 heads); Coder-V2 (236B) has the same shapes. INT4 g128 is 124.1 GB
# of checkpoint tensors (bf16 embedding, lm_head, norms, routers included): it is served at tensor_parallel_size >= 2.
V2: dict = dict(
    V2_LITE, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
    num_attention_heads=128, num_key_value_heads=128, n_routed_experts=160, routed_scaling_factor=16.0,
    q_lora_rank=1536, topk_method="group_limited_greedy", n_group=8, topk_group=3)

# DeepSeek-V3's config.json (61 layers, 671B parameters, 256 routed experts top-8 in 8 groups, 1 shared,
# MLA with q LoRA); R1 has the same shapes. The calibration plan (scripts/calib_plan.py) times one layer.
V3: dict = dict(
    V2_LITE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, q_lora_rank=1536, topk_method="noaux_tc", n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=0, eos_token_id=1)

SHAPES = {"v2-lite": V2_LITE, "v2": V2, "v3": V3}  # bench engine --model
SCHEMES = ("bf16", "fp8", "int4")
INT4_GROUP = 128
# the schemes' quantization_config: DeepSeek-V3's FP8 (no modules_to_not_convert), AutoAWQ's (null)
QUANT_CONFIG = {"fp8": Fp8BlockConfig(), "int4": AwqConfig(INT4_GROUP, modules_to_not_convert=())}


def make_config_dir(path: str | Path, config: dict, scheme: str = "bf16", **overrides) -> Path:
    """Write config.json (with the scheme's quantization_config) and the bundled tokenizer."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**config, **overrides}
    quant = QUANT_CONFIG.get(scheme)
    if scheme == "int4" and cfg.get("intermediate_size", 0) % INT4_GROUP:
        # V2-Lite's dense MLP (intermediate 10944 = 85.5 x 128): its down_proj has no g128 grid; keep it
        # BF16, as an AWQ g128 export of V2-Lite must
        dense_layers = range(cfg.get("first_k_dense_replace", 0))
        quant = replace(quant, modules_to_not_convert=tuple(f"model.layers.{i}.mlp.down_proj" for i in dense_layers))
    if quant is not None:
        cfg["quantization_config"] = quant.to_dict()
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    copy_tokenizer(path)
    return path


def copy_tokenizer(path: Path) -> None:
    """Put the bundled tokenizer's files into checkpoint directory `path`."""
    from dsquant.assets import tokenizer_path

    tok = Path(tokenizer_path())
    for f in (tok.glob("*") if tok.is_dir() else [tok]):
        if f.is_file():
            shutil.copy(f, path / f.name)


def random_hf_model(config: dict, seed: int = 0, std: float = 0.15, norm_std: float = 0.1,
                    bias_std: float = 0.1):
    """A transformers model of config.json-style `config` (its `architectures[0]` names the class),
    built after torch.manual_seed(seed), every weight redrawn N(0, std) in parameter order, norm
    weights 1 + N(0, norm_std) and DeepSeek-V3's e_score_correction_bias N(0, bias_std). A wide
    spread makes greedy decisions depend on every part of the model (attention over the whole
    context, routing, rope positions). norm_std / bias_std 0 keep transformers' ones / zeros and
    draw nothing for them (so the draws of the other weights stay as they were)."""
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    model_cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
            elif norm_std:
                p.copy_(1 + norm_std * torch.randn_like(p))
        for name, b in model.named_buffers():
            if bias_std and name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn_like(b))
    return model


def _checkpoint_layout(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor name: (shape, dtype)} the checkpoint of this config and scheme holds (meta model)."""
    from dsquant.models.causal_lm import CausalLM
    from dsquant.models.layers import Backends
    from dsquant.runtime.layers.linear import LinearFactory

    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, Backends(linear=LinearFactory(cfg.quantization_config)))
    def stored(name, dtype):  # the meta model's float placeholders are bf16 in the checkpoint
        return torch.bfloat16 if dtype == torch.float32 and not name.endswith("correction_bias") else dtype

    return {n: (tuple(p.shape), stored(n, p.dtype)) for n, p in model.named_parameters()}


@dataclass(frozen=True)
class RandomReaderSpec:
    """Picklable recipe of a RandomCheckpointReader: each tensor-parallel rank makes its own on its
    device (LLMEngine's reader_factory), with the same seeded draws, so every rank's shard is a slice
    of the same model."""

    model_dir: Path
    seed: int = 0
    std: float = 0.02

    def __call__(self, device: str | torch.device) -> "RandomCheckpointReader":
        return RandomCheckpointReader(self.model_dir, device=device, seed=self.seed, std=self.std)


class RandomCheckpointReader:
    """CheckpointReader over seeded random weights, made on `device` when asked for."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", seed: int = 0,
                 std: float = 0.02):
        self.root = Path(model_dir)
        self.device, self.seed, self.std = torch.device(device), seed, std
        fmt = parse_quantization_config(load_config(model_dir).quantization_config)
        self.scheme = {Fp8BlockConfig: "fp8", AwqConfig: "int4"}.get(type(fmt), "bf16")
        self.layout = _checkpoint_layout(self.root)  # {name: (shape, dtype)}
        self._pending: dict[str, torch.Tensor] = {}  # tensors of a module made together, not yet read
        from dsquant.models.checkpoint import layer_of

        self._layer_keys: dict[int | None, list[str]] = {}
        for key in self.layout:
            self._layer_keys.setdefault(layer_of(key), []).append(key)

    # -- the CheckpointReader surface the loaders use
    def keys(self) -> list[str]:
        return list(self.layout)

    def layer_keys(self, layer: int | None) -> list[str]:
        return list(self._layer_keys.get(layer, []))

    def __contains__(self, key: str) -> bool:
        return key in self.layout

    def file_of(self, key: str) -> Path:
        return self.root / "random-weights"

    def shape(self, key: str) -> tuple[int, ...]:
        return self.layout[key][0]

    def total_bytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.layout.values())

    def get(self, key: str) -> torch.Tensor:
        if key in self._pending:
            return self._pending.pop(key)
        if key not in self.layout:
            raise KeyError(f"{self.root}: random checkpoint has no tensor {key!r}")
        shape, dtype = self.layout[key]
        mod = key.rsplit(".", 1)[0]
        if self.scheme == "int4" and f"{mod}.qweight" in self.layout:
            self._pending.update(self._awq(mod))
            return self._pending.pop(key)
        if self.scheme == "fp8" and f"{mod}.weight_scale_inv" in self.layout:
            w = self.dense(f"{mod}.weight", self._dense_shape(mod))
            fp8, sinv = quantize_fp8_block(w)
            self._pending.update({f"{mod}.weight": fp8, f"{mod}.weight_scale_inv": sinv})
            return self._pending.pop(key)
        return self.dense(key, shape)

    # -- the random draws
    def dense(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The BF16 tensor `key` of the unquantized model (the same in every scheme)."""
        if "norm" in key.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
            return torch.ones(shape, dtype=torch.bfloat16, device=self.device)
        if key.endswith("e_score_correction_bias"):
            return torch.zeros(shape, dtype=torch.float32, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        return (torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
                * self.std).to(torch.bfloat16)

    def _dense_shape(self, mod: str) -> tuple[int, int]:
        if f"{mod}.qweight" in self.layout:  # AWQ qweight [K, N/8]
            k, n8 = self.layout[f"{mod}.qweight"][0]
            return n8 * 8, k
        return self.layout[f"{mod}.weight"][0]

    def _awq(self, mod: str) -> dict[str, torch.Tensor]:
        w = self.dense(f"{mod}.weight", self._dense_shape(mod))  # [N, K]
        q, s, z = quantize_int_groupwise(w.float(), INT4_GROUP)  # round to nearest
        qw, qz, sc = to_awq_tensors(q, s, z)
        return {f"{mod}.qweight": qw, f"{mod}.qzeros": qz, f"{mod}.scales": sc}


def bytes_per_decode_token(reader: RandomCheckpointReader, context: int) -> dict:
    """Bytes one decode token must read: every weight but the embedding table and the routed experts,
    top-k / E of the routed experts, and the KV cache at `context` tokens (bf16 MLA latent or K/V)."""
    cfg = load_config(reader.root)
    routed, other = 0, 0
    for key, (shape, dtype) in reader.layout.items():
        size = math.prod(shape) * dtype.itemsize
        if ".mlp.experts." in key:
            routed += size
        elif "embed_tokens" not in key:
            other += size
    active = routed * cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1)
    if cfg.is_deepseek:
        kv = cfg.num_hidden_layers * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    else:
        kv = cfg.num_hidden_layers * context * 2 * cfg.num_key_value_heads * cfg.dense_head_dim * 2
    return {"weights_other": other, "routed_active": int(active), "kv": kv,
            "total": int(other + active + kv)}


def write_random_checkpoint(out_dir: str | Path, config: dict, device: str = "cpu", seed: int = 0,
                            scheme: str = "bf16") -> Path:
    """Save the random model as safetensors, one shard per decoder layer, with an index. scheme
    "fp8" writes it as DeepSeek-V3 ships: e4m3 weights with 128 x 128 `weight_scale_inv` blocks."""
    from safetensors.torch import save_file

    from dsquant.export.writer import _file_mode

    out = make_config_dir(out_dir, config, scheme)
    reader = RandomCheckpointReader(out, device=device, seed=seed)
    groups: dict[str, list[str]] = {}
    for key in reader.keys():
        layer = key.split(".")[2] if key.startswith("model.layers.") else "other"
        groups.setdefault(layer, []).append(key)
    weight_map = {}
    for i, (layer, keys) in enumerate(sorted(groups.items())):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: reader.get(k).cpu().contiguous() for k in keys}, str(out / name), metadata={"format": "pt"})
        _file_mode(out / name)  # safetensors writes 0600; give it config.json's mode
        weight_map.update({k: name for k in keys})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out
