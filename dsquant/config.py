"""Model configuration read from a checkpoint's config.json: one dataclass, no globals.

Covers the four families dsquant serves (design.md): DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM, LlamaForCausalLM and Qwen2ForCausalLM. Field names follow the
checkpoints' own config.json; both the transformers-5 `rope_parameters` form and the older
`rope_theta` + `rope_scaling` form are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsquant.errors import ConfigError
from dsquant.formats.quantization_config import read_json_object
from dsquant.formats.quantization_config import resolve as resolve_quantization

DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
DENSE_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ARCHS = DEEPSEEK_ARCHS + DENSE_ARCHS
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass
class RopeConfig:
    """Rotary embedding: plain, or YaRN (DeepSeek V2/V3 long context) with its mscale terms."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn" | "linear" | "llama3"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass
class ModelConfig:
    """Everything the model builder needs; DeepSeek-only fields are ignored by dense families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = False  # q/k/v (and o for DeepSeek) bias; Qwen2 always has q/k/v bias
    rope: RopeConfig = field(default_factory=RopeConfig)
    # MLA (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    # MoE (DeepSeek)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    raw: dict = field(default_factory=dict, repr=False)
    # a quantization_config read from a side file (AutoAWQ quant_config.json, AutoGPTQ
    # quantize_config.json) when config.json has none; see formats/quantization_config.py
    side_quantization: dict | None = field(default=None, repr=False)
    quantization_source: str | None = None  # the file the quantization_config came from

    @property
    def is_deepseek(self) -> bool:
        return self.architecture in DEEPSEEK_ARCHS

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dense_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: MoE from `first_k_dense_replace` on, every `moe_layer_freq` layers."""
        return (self.is_deepseek and self.n_routed_experts > 0
                and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @property
    def quantization_config(self) -> dict | None:
        return self.raw.get("quantization_config") or self.side_quantization


def _rope_from_raw(raw: dict, where: str) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: per-layer-type rope_parameters are not supported")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn", "linear", "llama3"):
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported "
                          "(expected default, yarn, linear or llama3)")
    rope = RopeConfig(theta=float(theta), rope_type=rope_type)
    if rope_type != "default":
        if merged.get("factor") is None and rope_type != "yarn":
            raise ConfigError(f"{where}: rope scaling {rope_type!r} needs a 'factor'")
        rope.factor = float(merged["factor"]) if merged.get("factor") is not None else None
        rope.original_max_position_embeddings = merged.get("original_max_position_embeddings")
        rope.beta_fast = float(merged.get("beta_fast") or 32)
        rope.beta_slow = float(merged.get("beta_slow") or 1)
        rope.mscale = merged.get("mscale")
        rope.mscale_all_dim = merged.get("mscale_all_dim")
        rope.attention_factor = merged.get("attention_factor")
        rope.truncate = bool(merged.get("truncate", True))
        rope.low_freq_factor = float(merged.get("low_freq_factor", 1.0))
        rope.high_freq_factor = float(merged.get("high_freq_factor", 4.0))
        if rope_type in ("yarn", "llama3") and rope.original_max_position_embeddings is None:
            raise ConfigError(f"{where}: rope scaling {rope_type!r} needs "
                              "'original_max_position_embeddings'")
        if rope.factor is None:  # DeepSeek-V3 style: ratio of the context lengths
            rope.factor = raw["max_position_embeddings"] / rope.original_max_position_embeddings
    return rope


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def config_from_dict(raw: dict, where: str = "config.json") -> ModelConfig:
    """Validate and convert a config.json dict; errors name `where` and the field."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError(f"{where}: field 'architectures' is missing; expected one of "
                          f"{', '.join(SUPPORTED_ARCHS)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"{where}: architecture {arch!r} is not supported; expected one of "
                          f"{', '.join(SUPPORTED_ARCHS)}")
    for key in _REQUIRED:
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ConfigError(f"{where}: field {key!r} must be a positive integer, "
                              f"found {raw.get(key)!r}")
    deepseek = arch in DEEPSEEK_ARCHS
    heads = raw["num_attention_heads"]
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size", 4 * raw["hidden_size"]),
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        head_dim=None if deepseek else raw.get("head_dim"),
        attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
        rope=_rope_from_raw(raw, where),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        raw=raw,
        quantization_source="config.json" if raw.get("quantization_config") else None,
    )
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported (expected 'silu')")
    if heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {cfg.num_key_value_heads}")
    if deepseek:
        _read_deepseek_fields(cfg, raw, where)
    return cfg


def _read_deepseek_fields(cfg: ModelConfig, raw: dict, where: str) -> None:
    v3 = cfg.architecture == "DeepseekV3ForCausalLM"
    cfg.q_lora_rank = raw.get("q_lora_rank")
    cfg.kv_lora_rank = raw.get("kv_lora_rank", 512)
    cfg.qk_nope_head_dim = raw.get("qk_nope_head_dim", 128)
    cfg.qk_rope_head_dim = raw.get("qk_rope_head_dim", 64)
    cfg.v_head_dim = raw.get("v_head_dim", 128)
    # transformers' V2 always interleaves; V3 reads `rope_interleave` (default True)
    cfg.rope_interleave = bool(raw.get("rope_interleave", True)) if v3 else True
    cfg.n_routed_experts = raw.get("n_routed_experts") or 0
    cfg.n_shared_experts = raw.get("n_shared_experts") or 0
    cfg.num_experts_per_tok = raw.get("num_experts_per_tok") or 0
    cfg.moe_intermediate_size = raw.get("moe_intermediate_size") or 0
    cfg.first_k_dense_replace = raw.get("first_k_dense_replace") or 0
    cfg.moe_layer_freq = raw.get("moe_layer_freq") or 1
    cfg.topk_method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    cfg.scoring_func = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    cfg.n_group = raw.get("n_group") or 1
    cfg.topk_group = raw.get("topk_group") or 1
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", v3))
    cfg.routed_scaling_factor = float(raw.get("routed_scaling_factor") or 1.0)
    if cfg.topk_method not in TOPK_METHODS:
        raise ConfigError(f"{where}: topk_method {cfg.topk_method!r} is not supported; expected one "
                          f"of {', '.join(TOPK_METHODS)}")
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"{where}: scoring_func {cfg.scoring_func!r} is not supported "
                          "(expected softmax or sigmoid)")
    if cfg.n_routed_experts:
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError(f"{where}: n_routed_experts {cfg.n_routed_experts} is not a multiple "
                              f"of n_group {cfg.n_group}")
        if cfg.num_experts_per_tok <= 0 or cfg.moe_intermediate_size <= 0:
            raise ConfigError(f"{where}: MoE needs positive num_experts_per_tok and "
                              "moe_intermediate_size")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json`; errors name the path and what was expected."""
    path = Path(model_dir)
    if not path.exists():
        raise ConfigError(f"{path}: no such directory")
    if not path.is_dir():
        raise ConfigError(f"{path}: expected a checkpoint directory, found a file")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path}: missing; a checkpoint directory needs config.json")
    raw = read_json_object(cfg_path)
    cfg = config_from_dict(raw, str(cfg_path))
    quant, source = resolve_quantization(path, raw)
    if quant is not None and "quantization_config" not in raw:
        cfg.side_quantization = quant
    cfg.quantization_source = source
    return cfg
