"""Measured sensitivity: the output KL of the model with one (layer, group, scheme) quantized alone.

One pass streams the calibration set through the BF16 model layer by layer (as `quantize` does,
calibrate/layer.py): at layer i, for each group and scheme, a copy of the layer is calibrated and
quantized by `quantize_layer` with a recipe giving only that group the scheme (AWQ scale search,
clip search, FP8 blocks: exactly what quantize would do to it, on the same inputs), then the layer
moves on as BF16. Each candidate layer is swapped into the otherwise BF16 model and scored with
validate's `compare` on held-out calibration tokens: mean KL(BF16 || candidate) per token and the
change of the held-out NLL. Held-out means samples drawn from the calibration (training) corpus
beyond the first n_samples, never the evaluation sets.

What this chooses: real KL per candidate, affordable on the bundled models (a few seconds each);
each candidate holds one layer copy. Calibration inputs are the BF16 predecessors' outputs (each
candidate is alone), where quantize feeds the quantized predecessors' outputs. A layer-local proxy
is recorded next to the KL (the relative squared error of the layer's output on the held-out
tokens); tune.md shows how well it ranks the candidates against the real KL, the evidence needed
before the proxy could replace the KL on a model too large to rescore per candidate.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsquant.calibrate.layer import layer_forward, quantize_layer
from dsquant.calibrate.recipe import AWQOptions, Recipe
from dsquant.calibrate.resolve import resolve_schemes
from dsquant.export import codecs
from dsquant.tune.space import KEEP, SCHEMES, Space
from dsquant.validate.accuracy import compare


@dataclass
class SensitivityArgs:
    model_dir: str
    n_samples: int = 16  # calibration sequences
    seqlen: int = 256
    n_heldout: int = 8  # further sequences of the calibration corpus, scored for KL
    seed: int = 0
    device: str = "cpu"
    batch_size: int = 8
    awq_grid: int = 20


@dataclass
class Candidate:
    layer: int
    group: str
    scheme: str
    kl: float  # mean KL(BF16 || candidate) per held-out token, nats
    dnll: float  # held-out NLL per token, candidate minus BF16
    proxy: float  # ||layer_q(h) - layer(h)||^2 / ||layer(h)||^2 on the held-out inputs
    seconds: float = 0.0


@dataclass
class Sensitivity:
    candidates: list[Candidate]
    base_nll: float  # held-out NLL per token of the BF16 model
    heldout_tokens: int
    calib_tokens: int
    window: int
    notes: list[str] = field(default_factory=list)

    def lookup(self) -> dict[tuple[int, str, str], Candidate]:
        return {(c.layer, c.group, c.scheme): c for c in self.candidates}


class SwappedModel:
    """The BF16 model with decoder layer `index` replaced: a callable ids [B, T] -> logits [B, T, V]."""

    def __init__(self, model, index: int, layer):
        self.model, self.index, self.layer = model, index, layer

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        ctx = self.model.eager_context(positions)
        hidden = self.model.embed(ids)  # [B, T, H]
        for j, layer in enumerate(self.model.model.layers):
            hidden = (self.layer if j == self.index else layer)(hidden, ctx)
        return self.model.logits(hidden)


def calibration_split(model_dir: str, n_samples: int, n_heldout: int, seqlen: int, seed: int):
    """(calibration [n, T], held-out [h, T]) from one draw of the bundled calibration set: each
    sample from a different training document, so the held-out ones share no window with the rest."""
    from dsquant.data import calibration_samples, load_tokenizer

    tokens = calibration_samples(load_tokenizer(Path(model_dir)), n_samples + n_heldout, seqlen, seed)
    return tokens[:n_samples], tokens[n_samples:]


def _candidate_recipe(space: Space, modules: tuple[str, ...], scheme: str, awq_grid: int) -> Recipe:
    rules = [(m, SCHEMES[scheme]) for m in modules]
    return Recipe(name=f"tune-{scheme}", default=SCHEMES["bf16"], rules=rules, keep=list(KEEP),
                  awq=AWQOptions(grid=awq_grid, clip_grid=awq_grid))


def _proxy(layer, cand, hidden: torch.Tensor, ctx, batch: int) -> float:
    ref = layer_forward(layer, hidden, ctx, batch).to(torch.float32)  # [h, T, H]
    out = layer_forward(cand, hidden, ctx, batch).to(torch.float32)
    return float((out - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-30))


def measure(args: SensitivityArgs, space: Space, progress=print) -> Sensitivity:
    """Every (layer, group, scheme != bf16) candidate's held-out KL, in one streamed pass."""
    import time

    from dsquant.models.loader import load_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model_dir, dtype=dtype, device=device)
    calib, held = calibration_split(args.model_dir, args.n_samples, args.n_heldout, args.seqlen, args.seed)
    stream = held.reshape(-1)  # [h * T]; windows of T tokens, each scoring T - 1 new targets
    window, stride = args.seqlen, args.seqlen - 1
    positions = torch.arange(args.seqlen, device=device)[None]
    ctx = model.eager_context(positions)
    scale_dtype = codecs.scale_dtype_for("compressed-tensors")  # mixed recipes export compressed-tensors
    with torch.no_grad():
        hidden = model.embed(calib.to(device))  # [n, T, H]
        held_hidden = model.embed(held.to(device))  # [h, T, H]
    candidates, base_nll = [], None
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        swapped, meta = {}, {}
        for group in (g for g in space.groups if g.layer == i):
            unit = next(u for u in space.units if group in u.groups)
            for scheme in unit.options[1:]:
                t0 = time.time()
                recipe = _candidate_recipe(space, group.modules, scheme, args.awq_grid)
                specs = resolve_schemes({n: space.shapes[n] for n in space.shapes if n.startswith(prefix + ".")},
                                        recipe).specs
                cand = copy.deepcopy(layer)
                quantize_layer(cand, prefix, hidden, ctx, recipe, specs, scale_dtype, args.batch_size)
                key = f"{group.name}/{scheme}"
                swapped[key] = SwappedModel(model, i, cand)
                meta[key] = (group.name, scheme, _proxy(layer, cand, held_hidden, ctx, args.batch_size),
                             time.time() - t0)
        if swapped:
            base, results = compare(model, swapped, stream, "heldout", window, stride, device)
            base_nll = math.log(base.perplexity.value)
            for key, acc in results.items():
                name, scheme, proxy, secs = meta[key]
                candidates.append(Candidate(i, name, scheme, max(0.0, acc.kl_mean.value),
                                            math.log(acc.perplexity.value) - base_nll, proxy, round(secs, 2)))
        progress(f"sensitivity: layer {i + 1}/{len(model.model.layers)} ({len(swapped)} candidates)")
        del swapped
        hidden = layer_forward(layer, hidden, ctx, args.batch_size)
        held_hidden = layer_forward(layer, held_hidden, ctx, args.batch_size)
    return Sensitivity(candidates, base_nll if base_nll is not None else float("nan"), int(stream.numel()),
                       int(calib.numel()), window)
