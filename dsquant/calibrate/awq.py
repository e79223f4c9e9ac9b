"""AWQ: activation-aware weight quantization (Lin et al., arXiv 2306.00978), our implementation.

A scaling group is the set of Linears fed by one tensor (a norm's output, or an up_proj's
output for its down_proj). A per-input-channel scale s is searched on a grid: s = x_mean^a /
w_mean^(1-a) ("duo scaling": the weight-magnitude term), normalised, for a in [0, 1); each
member's weight becomes Q(W * s) / s and the loss is the MSE of all members' outputs on their
captured inputs. The best s is folded exactly: members' weights times s, the producer's
output divided by s. Then a per-group clip search shrinks each group's range (1 down to
1 - max_shrink) to minimise that group's output error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.calibrate.quantizers import fake_int, fake_quant
from dsquant.calibrate.recipe import AWQOptions, SchemeSpec


@dataclass
class Member:
    """One Linear of a scaling group: its weight [N, K] (the layer's dtype: bf16 on a GPU, read in
    fp32 one member at a time), scheme and captured inputs [T, K] fp32. input_key names the tensor
    it reads (capture.Captured.input_key; its own name when not given): members of one key have
    one and the same x, computed on once."""

    name: str
    weight: torch.Tensor
    spec: SchemeSpec
    x: torch.Tensor
    input_key: str = ""

    def __post_init__(self):
        self.input_key = self.input_key or self.name


def _w_mean(members: list[Member]) -> torch.Tensor:
    """Mean over output rows of |W| normalised by each quantization group's max: [K]."""
    parts = []
    for m in members:
        n, k = m.weight.shape
        g = m.spec.group_size if m.spec.is_int else k
        w = m.weight.float().abs().reshape(n, k // g, g)
        w = w / w.amax(-1, keepdim=True).clamp(min=1e-8)
        parts.append(w.reshape(n, k))
    return torch.cat(parts).mean(0)


CONCAT_BYTES = 1 << 28  # up to this, x_mean concatenates the rows as it always has


def _x_mean(members: list[Member]) -> torch.Tensor:
    """Mean |x| [K] over all members' captured rows (as if concatenated).

    Up to CONCAT_BYTES of rows, concatenated; beyond, one member at a time (an MoE layer's gate/up
    group holds every expert's rows: a concatenation and its abs took 3.8 GB on the V2-Lite shape).
    The two differ in the last bit of a float sum, and that is enough to move AWQ's choices: on
    dsq-tiny-v3 eval_prose 69.608 (concatenated) against 70.004 (streamed), RTN 69.964
    (BENCHMARKS.md, 2026-12-02). Small groups keep the concatenation, so their results stay put."""
    xs = [m.x for m in members if m.x.numel()]
    if sum(x.numel() for x in xs) * 4 <= CONCAT_BYTES:
        return torch.cat(xs).abs().mean(0)
    total, rows, sums = None, 0, {}
    for m in members:
        if not m.x.numel():
            continue
        if m.input_key not in sums:  # members fed one tensor (gate and up): summed once
            sums[m.input_key] = m.x.abs().sum(0)
        part = sums[m.input_key]
        total = part.clone() if total is None else total.add_(part)
        rows += m.x.shape[0]
    return total / rows


def candidate_scales(members: list[Member], opts: AWQOptions):
    """The grid of per-input-channel scales s [K] (a in 0, 1/grid, ..., duo scaling)."""
    x_mean = _x_mean(members).clamp(min=1e-6)
    w_mean = _w_mean(members).clamp(min=1e-6)
    for i in range(opts.grid):
        a = i / opts.grid
        s = x_mean.pow(a) / w_mean.pow(1 - a) if opts.duo_scaling else x_mean.pow(a)
        yield (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)


def _candidate(m: Member, s: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Q(W * s) / s [N, K] fp32: what scale s does to member m's weight."""
    return fake_quant(m.weight.float() * s, m.spec, scale_dtype) / s


def _stacked_candidates(members: list[Member], s: torch.Tensor, scale_dtype: torch.dtype,
                        batch_bytes: int = 1 << 29) -> dict[str, torch.Tensor]:
    """{name: Q(W * s) / s [N, K] in the member's dtype} for every member: INT members of one
    shape, spec and dtype stacked ([E*N, K]: groups run along K within a row, so stacking rows
    changes nothing) in batches of `batch_bytes` of fp32, a few launches a batch instead of a
    few dozen a member (an MoE layer's gate/up group has 130 members); others one by one."""
    out: dict[str, torch.Tensor] = {}
    kinds: dict[tuple, list[Member]] = {}
    for m in members:
        if m.spec.is_int:
            kinds.setdefault((tuple(m.weight.shape), m.spec, m.weight.dtype), []).append(m)
        else:
            out[m.name] = _candidate(m, s, scale_dtype).to(m.weight.dtype)
    for ((n, k), spec, dtype), group in kinds.items():
        size = max(1, batch_bytes // (3 * 4 * n * k))  # the stacked weights, their grid, the division
        for start in range(0, len(group), size):
            part = group[start:start + size]
            w = torch.stack([m.weight for m in part]).float().mul_(s)  # [E, N, K]
            q = fake_quant(w.reshape(-1, k), spec, scale_dtype).reshape(w.shape).div_(s).to(dtype)
            del w
            out.update(zip((m.name for m in part), q.unbind(0)))
    return {m.name: out[m.name] for m in members}


def search_scales(members: list[Member], opts: AWQOptions, scale_dtype: torch.dtype,
                  block_loss=None) -> torch.Tensor:
    """Best per-input-channel scale s [K] for the group (ones if no member is an INT scheme).

    block_loss(weights: {name: W' [N, K]}) -> float, when given, scores the members' scaled
    fake-quantized weights by the output of the block they feed (AWQ's module-to-inspect);
    otherwise the loss is the MSE of the members' own outputs on their captured inputs.
    """
    k = members[0].weight.shape[1]
    device = members[0].weight.device
    if not any(m.spec.is_int for m in members) or not any(m.x.numel() for m in members):
        return torch.ones(k, device=device)
    refs = [] if block_loss is not None else [m.x @ m.weight.float().t() for m in members]  # [T_m, N_m]
    total = sum(r.numel() for r in refs)
    best, best_loss = torch.ones(k, device=device), float("inf")
    for s in candidate_scales(members, opts):
        if block_loss is not None:  # the candidates in the layer's dtype, which block_loss runs in
            loss = block_loss(_stacked_candidates(members, s, scale_dtype))
        else:
            loss = sum(float((m.x @ _candidate(m, s, scale_dtype).t() - ref).pow(2).sum())
                       for m, ref in zip(members, refs) if m.x.numel()) / max(total, 1)
        if loss < best_loss:
            best, best_loss = s, loss
    return best


def search_clip(x: torch.Tensor, w: torch.Tensor, spec: SchemeSpec, opts: AWQOptions,
                scale_dtype: torch.dtype, max_tokens: int = 4096) -> torch.Tensor:
    """Per (output row, group) shrink ratio [N, K/G] minimising that group's output error on up to
    max_tokens rows of x [T, K]."""
    n, k = w.shape
    g = spec.group_size
    if x.numel() == 0:
        return torch.ones(n, k // g, device=w.device)
    gram = _group_gram(_subsample(x, max_tokens), g)  # [K/G, G, G]
    return _clip_ratios(w.float()[None], gram[None], spec, opts, scale_dtype)[0]


def _clip_ratios(w: torch.Tensor, gram: torch.Tensor, spec: SchemeSpec, opts: AWQOptions,
                 scale_dtype: torch.dtype) -> torch.Tensor:
    """The clip grid for E Linears at once: w [E, N, K] fp32, their inputs' Gram matrices gram
    [E, K/G, G, G]; each candidate fake-quantized in one call ([E*N, K]: groups run along K within
    a row) and scored in one batched product. Returns ratio [E, N, K/G]. With E = 1 it is the
    one-Linear search bitwise (the same product: einsum folds E into G's batch)."""
    e, n, k = w.shape
    g = spec.group_size
    ratio = torch.ones(e, n, k // g, device=w.device)
    best = torch.full((e, n, k // g), float("inf"), device=w.device)
    for i in range(opts.clip_grid):
        r = 1 - opts.max_shrink * i / opts.clip_grid
        diff = fake_int(w.reshape(e * n, k), spec, scale_dtype, clip_ratio=r).reshape(e, n, k // g, g)
        diff.sub_(w.reshape(e, n, k // g, g))
        err = (torch.einsum("engi,egij->engj", diff, gram) * diff).sum(-1)  # [E, N, K/G]
        better = err < best
        best = torch.where(better, err, best)
        ratio = torch.where(better, torch.full_like(ratio, r), ratio)
    return ratio


def _subsample(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    if x.shape[0] > max_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()]
    return x


def _group_gram(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [T, K] -> per-group Gram matrices [K/G, G, G]: a group's output error sum_t (x_g . d)^2 is
    d H_g d^T with H_g = x_g^T x_g, so a clip candidate costs N K G instead of T N K."""
    xg = x.reshape(x.shape[0], x.shape[1] // g, g)  # [T, K/G, G]
    return torch.einsum("tgi,tgj->gij", xg, xg)


def search_clip_experts(members: list[Member], opts: AWQOptions, scale_dtype: torch.dtype,
                        max_tokens: int = 4096, batch_bytes: int = 1 << 30) -> list[torch.Tensor]:
    """search_clip for many Linears of one shape [N, K] and spec (the routed experts'), a batch of
    them searched at once (_clip_ratios); members of one input key share their Gram matrices.
    Each member's x [T_i, K] fp32, weight [N, K]; returns each one's ratio [N, K/G]."""
    n, k = members[0].weight.shape
    spec = members[0].spec
    g = spec.group_size
    size = max(1, batch_bytes // (5 * 4 * n * k))  # weights, candidates, difference, products (fp32)
    out: list[torch.Tensor] = []
    for start in range(0, len(members), size):
        part = members[start:start + size]
        device = part[0].weight.device
        grams: dict[str, torch.Tensor] = {}
        for m in part:
            if m.input_key not in grams:  # gate and up: one Gram
                grams[m.input_key] = (_group_gram(_subsample(m.x, max_tokens), g) if m.x.numel()
                                      else torch.zeros(k // g, g, g, device=device))
        gram = torch.stack([grams[m.input_key] for m in part])  # [E, K/G, G, G]
        del grams
        w = torch.stack([m.weight.float() for m in part])  # [E, N, K]
        ratio = _clip_ratios(w, gram, spec, opts, scale_dtype)
        del w, gram
        ratio[[j for j, m in enumerate(part) if not m.x.numel()]] = 1.0
        out += list(ratio.unbind(0))
    return out


def search_scales_experts(groups: list[Member], opts: AWQOptions, scale_dtype: torch.dtype,
                          chunk: int = 8) -> list[torch.Tensor]:
    """Best scale s [K] for each routed expert's up -> down group, scored on the expert's own
    output (its down_proj on its own routed tokens), `chunk` experts per batched GEMM.

    groups: one Member per expert (its down_proj), weights all [N, K]. For each grid point, the
    chunk's candidate weights are fake-quantized in one call ([E*N, K]: groups run along K within
    a row, so stacking rows of experts changes nothing) and scored in one bmm over the experts'
    inputs zero-padded to the longest (a zero row adds zero error). Same loss and grid as
    search_scales(..., block_loss=None), expert by expert."""
    out: list[torch.Tensor] = []
    for start in range(0, len(groups), chunk):
        part = groups[start:start + chunk]
        n, k = part[0].weight.shape
        device = part[0].weight.device
        live = [i for i, m in enumerate(part) if m.spec.is_int and m.x.numel()]
        best = [torch.ones(k, device=device) for _ in part]
        if not live:
            out += best
            continue
        members = [part[i] for i in live]
        t_max = max(m.x.shape[0] for m in members)
        x = torch.zeros(len(members), t_max, k, device=device)  # [E, T, K]
        for e, m in enumerate(members):
            x[e, :m.x.shape[0]] = m.x
        w = torch.stack([m.weight.float() for m in members])  # [E, N, K]
        ref = torch.bmm(x, w.transpose(1, 2))  # [E, T, N]
        counts = torch.tensor([m.x.shape[0] * n for m in members], device=device, dtype=torch.float32)
        best_loss = torch.full((len(members),), float("inf"), device=device)
        grids = [candidate_scales([m], opts) for m in members]
        spec = members[0].spec
        for _ in range(opts.grid):
            s = torch.stack([next(g) for g in grids])  # [E, K]
            wq = fake_quant((w * s[:, None, :]).reshape(-1, k), spec, scale_dtype).reshape(w.shape) / s[:, None, :]
            loss = (torch.bmm(x, wq.transpose(1, 2)) - ref).pow(2).sum((1, 2)) / counts  # [E]
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            for e in better.nonzero().flatten().tolist():
                best[live[e]] = s[e]
        out += best
    return out
