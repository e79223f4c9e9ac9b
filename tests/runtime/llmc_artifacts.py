"""compressed-tensors checkpoints laid out as llm-compressor writes them, built with the library.

llm-compressor's `oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=S,
ignore=IGNORE))` followed by `model.save_pretrained(out, save_compressed=True)`:
  1. apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": preset S on
     "Linear"}, ignore=IGNORE)) attaches the scheme and empty qparams (weight_scale in the
     weight's dtype, bf16 here) to every targeted nn.Linear;
  2. weight qparams from a min-max observer per group (W4A16) or per 128 x 128 block (FP8_BLOCK),
     through compressed_tensors' calculate_qparams (llm-compressor's memoryless min-max observer;
     RTN: no data-dependent search);
  3. ModelCompressor.from_pretrained_model(model) infers the format (pack-quantized,
     float-quantized) and the ignore list (every un-quantized Linear, by name),
     compress_model() swaps each module's weight for its compressed tensors, the state dict is
     saved, and update_config() writes config.json's quantization_config.
The stand-in for the transformers model is an nn.Module tree with one nn.Linear per checkpoint
Linear, named as in the checkpoint (transformers 5 fuses DeepSeek experts into 3-D parameters;
llm-compressor unfuses them into per-expert Linears for calibration and saves them per expert,
as here). Embeddings and norms are not Linear, so no scheme reaches them; lm_head and the MoE
router (`mlp.gate`, a Linear-shaped [E, hidden] weight) are ignored as llm-compressor's
DeepSeek examples do.

`dense_twin` writes the weights the compressed checkpoint encodes, decompressed by the same
library (in fp32), as a plain float checkpoint: the reference for dsquant's reading of the format.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor, decompress_module
from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, QuantizationStrategy,
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

SCHEMES = {"ct-w4a16": "W4A16", "ct-fp8-block": "FP8_BLOCK"}  # artifact name -> llm-compressor preset
IGNORE = ["lm_head", "re:.*mlp.gate$"]
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint, as stored (bf16 for the bundled models)."""
    out = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Modules that are nn.Linear in the transformers model: 2-D `.weight`s except embeddings."""
    return sorted(k[: -len(".weight")] for k, t in state.items()
                  if k.endswith(".weight") and t.ndim == 2 and not k.endswith("embed_tokens.weight"))


def _tree(state: dict[str, torch.Tensor], names: list[str]) -> nn.Module:
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        w, b = state[f"{name}.weight"], state.get(f"{name}.bias")
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
        lin.weight = nn.Parameter(w.clone(), requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b.clone(), requires_grad=False)
        parent.add_module(leaf, lin)
    return root


def _observe_weight(module: nn.Linear) -> None:
    """Min-max weight qparams (llm-compressor's weight observer), written into the module's
    weight_scale / weight_zero_point."""
    args = module.quantization_scheme.weights
    w = module.weight.data  # [N, K]
    if args.strategy == QuantizationStrategy.GROUP:
        g = w.unflatten(-1, (-1, args.group_size))  # [N, K/G, G]
        lo, hi = g.amin(-1), g.amax(-1)  # [N, K/G]
    elif args.strategy == QuantizationStrategy.BLOCK:
        bn, bk = args.block_structure
        n, k = w.shape
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype)
        padded[:n, :k] = w  # zero padding: calculate_qparams widens every range to include 0 anyway
        blocks = padded.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))  # [N/bn, bn, K/bk, bk]
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))  # [N/bn, K/bk]
    else:
        raise ValueError(f"unexpected weight strategy {args.strategy}")
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    module.quantization_status = QuantizationStatus.FROZEN


def _side_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def _save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def build(model_dir: str | Path, out_dir: str | Path, name: str, twin_dir: str | Path | None = None) -> Path:
    """Write `name` ("ct-w4a16" | "ct-fp8-block") of `model_dir` to `out_dir` as llm-compressor
    would; with `twin_dir`, also the dense checkpoint of the weights it encodes (fp32, decompressed
    by compressed_tensors)."""
    src, out = Path(model_dir), Path(out_dir)
    state = read_checkpoint(src)
    names = linear_names(state)
    tied = "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    if tied:  # tie_word_embeddings: the transformers model still has an lm_head Linear (ignored)
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        names.append("lm_head")
    root = _tree(state, names)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(SCHEMES[name], ["Linear"])},
                                ignore=IGNORE)
    apply_quantization_config(root, config, show_progress=False)
    quantized = [m for m in root.modules() if getattr(m, "quantization_scheme", None) is not None]
    if not quantized:
        raise AssertionError(f"{name}: no Linear of {src} matched the scheme")
    for m in quantized:
        _observe_weight(m)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    linear_keys = {f"{n}.{p}" for n in names for p in ("weight", "bias")}
    rest = {k: v for k, v in state.items() if k not in linear_keys}  # embeddings, norms, router bias
    tensors = {**rest, **root.state_dict()}
    if tied:  # transformers does not save a tied lm_head
        tensors.pop("lm_head.weight")
    _side_files(src, out)
    _save(tensors, out)
    compressor.update_config(str(out))
    if twin_dir is not None:
        dense_twin(root, rest, src, Path(twin_dir), tied)
    return out


def dense_twin(root: nn.Module, rest: dict[str, torch.Tensor], src: Path, out: Path, tied: bool = False) -> None:
    """Decompress every compressed module of `root` with compressed_tensors (fp32) and save the
    result without a quantization_config."""
    for m in root.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            # fp32 scales: the library dequantizes in the scale's dtype, and bf16 would round
            # (q * s) again; the stored bf16 scales are exact in fp32
            m.weight_scale = nn.Parameter(m.weight_scale.data.float(), requires_grad=False)
            decompress_module(m)
    dense = {k: v for k, v in root.state_dict().items() if k.endswith((".weight", ".bias"))}
    if tied:
        dense.pop("lm_head.weight")
    _side_files(src, out)
    _save({**rest, **{k: v.float() for k, v in dense.items()}}, out)


def quantization_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())["quantization_config"]
