"""Convert a GGUF file (llama.cpp's format) of a dense Llama or Qwen2 model into an HF checkpoint.

Reads only the GGUF container (metadata and tensor bytes, through the `gguf` package's reader and
dequantizer); nothing in the file is executed or unpickled. Writes the directory that dsquant and
transformers load: config.json, generation_config.json, tokenizer.json (a byte-level BPE rebuilt
from the GGUF vocabulary and merges), tokenizer_config.json and model.safetensors.

Two facts of llama.cpp's converter are undone here:
- for `llama`, the rows of q/k projections are permuted from HF's rotate-half RoPE layout into
  interleaved pairs (per head: [x0, x_{d/2}, x1, x_{d/2+1}, ...]); `unpermute_qk` restores them.
- GGUF shapes list the fastest dimension first; a weight of HF shape [out, in] is stored as
  (in, out).
Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants ...) are dequantized to float32 first, so a model that
was shipped quantized is converted exactly as its shipped weights are, not as its original was.

Needs the optional dependency `gguf` (pip install 'dsquant[gguf]').
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from dsquant.errors import DsquantError

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise DsquantError("reading GGUF needs the 'gguf' package: pip install 'dsquant[gguf]'") from None
    return GGUFReader(str(path))


def read_metadata(reader) -> dict:
    """The GGUF key/value metadata as plain Python values (arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def map_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor name; DsquantError for an unknown one."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise DsquantError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def dequantize_tensor(t) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in HF (row-major, slowest dimension first) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(t.data, dtype=np.float32)
    elif t.tensor_type == GGMLQuantizationType.BF16:
        raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a writable copy


def hf_config(meta: dict, has_output: bool, dtype: str) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise DsquantError(f"GGUF architecture {arch!r} is not supported (expected {', '.join(SUPPORTED)})")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    vocab = int(a("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    head_dim = int(a("attention.key_length") or hidden // heads)
    cfg = {
        "architectures": [SUPPORTED[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(a("context_length", 2048)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "rope_parameters": {"rope_theta": float(a("rope.freq_base", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if a("rope.scaling.type") not in (None, "none"):
        raise DsquantError(f"GGUF rope scaling {a('rope.scaling.type')!r} is not supported by this converter")
    return cfg


def build_tokenizer(meta: dict, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json from a GGUF 'gpt2' (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DsquantError(f"GGUF tokenizer model {kind!r} is not supported (expected gpt2 byte-level BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # these split every digit on its own first
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise DsquantError(f"GGUF pre-tokenizer {pre!r} is not supported by this converter")
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(special)
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"), "eos_token": name("eos"), "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    if meta.get("tokenizer.chat_template"):
        tcfg["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write an HF checkpoint of `gguf_path` into `out_dir` (created); returns out_dir."""
    from safetensors.torch import save_file

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise DsquantError(f"dtype {dtype!r}: expected bfloat16, float16 or float32")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _reader(gguf_path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = hf_config(meta, has_output="output.weight" in names, dtype=dtype)
    arch = meta["general.architecture"]
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise DsquantError("GGUF carries rope_freqs (llama3-style scaling): not supported")
        hf_name = map_name(t.name)
        w = dequantize_tensor(t)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        tensors[hf_name] = w.to(torch_dtype).contiguous()
    n_layers = cfg["num_hidden_layers"]
    expected = 3 + 9 * n_layers - (1 if cfg["tie_word_embeddings"] else 0)
    if len([k for k in tensors if not k.endswith(".bias")]) != expected:
        raise DsquantError(f"{gguf_path}: {len(tensors)} tensors, expected {expected} weights for "
                           f"{n_layers} layers")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    build_tokenizer(meta, out_dir)
    return out_dir


def parameter_count(model_dir: str | Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
