"""`dsquant bench moe`: fused MoE experts beside a bf16 loop over experts, DeepSeek-V2-Lite layer.

Layer: 64 routed experts (softmax greedy top-6), 2 shared experts, hidden 2048, expert
intermediate 1408, bf16 activations, random weights and inputs. For T tokens and each format:
- dsquant: fused_moe (moe_align + gate/up grouped GEMM with SiLU-and-mul + down grouped GEMM with
  the routing weights + top-k sum), shared experts run as two extra always-selected experts;
  BF16, INT4 (AWQ g128 repacked) and FP8 block (128x128 weights, per-token-group activations).
  INT4 with at most moe_gemv.MOE_GEMV_MAX_PAIRS pairs (T <= 2 here) runs the per-pair GEMVs
  instead (no alignment; moe_gemv.py); the "config" column says "gemv" then. One token on the
  grouped GEMMs (BF16, FP8) runs a block per pair without moe_align ("pair blocks"; FP8 also
  quantizes the activations inside the GEMMs); the align columns time moe_align alone regardless. FP8's per-pair GEMV
  (moe_gemv_fp8.py) is not dispatched (slower); --sweep int4 / fp8 also times that format's GEMV at every GEMV_SWEEP (block_n, warps)
  and GEMV_SPLITS split_k, whatever the pair count (FP8 also in its elementwise form on an
  activation quantized once, kernel "gemv_elementwise_prequant"); each row names its block_n, num_warps,
  split_k asked for and used per projection (split_k_gate_up, split_k_down), "auto" being
  moe_gemv.default_split_k, what fused_moe runs.
- peer: transformers' experts forward (loop over the experts hit: gather, gate_up linear,
  silu*mul, down linear, weight, index_add) plus the shared MLP, in bf16 on the same bf16
  weights (the quantized formats are quantized from them). The peer's per-expert token indices
  are computed before timing, so its loop has no host sync and can be graph-captured.
Both start from the same routing (topk ids and weights); routing itself is not timed.
--layers copies of the weights are cycled through (like consecutive decoder layers), so weights
are read from HBM rather than L2; times are per layer. Active bytes = the weight bytes (with
scales/zeros) of the distinct experts the batch selects, incl. the shared ones; GB/s = those
bytes / graph time, against the 4.25 TB/s copy roofline.
"""
from __future__ import annotations

from dataclasses import dataclass

import click

E, N_SHARED, TOP_K, H, I = 64, 2, 6, 2048, 1408
ROOFLINE_GBS = 4250.0
SWEEP = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 32, 128, 2, 4),
         (16, 64, 128, 2, 4), (16, 64, 128, 4, 2), (16, 64, 128, 8, 4), (32, 64, 128, 4, 3),
         (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (16, 128, 128, 4, 4), (32, 128, 128, 4, 4),
         (32, 64, 128, 4, 4), (64, 128, 128, 4, 4), (16, 128, 128, 4, 2), (16, 128, 128, 2, 3),
         (16, 128, 128, 8, 3), (16, 256, 128, 4, 3), (16, 256, 128, 8, 3)]


@dataclass
class Row:
    format: str
    tokens: int
    dsquant_graph_us: float
    dsquant_eager_us: float
    peer_graph_us: float
    peer_eager_us: float
    speedup_graph: float  # peer / dsquant, graph replays
    speedup_eager: float
    active_experts: float  # distinct experts read per layer (incl. shared)
    active_mb: float
    dsquant_gbs: float
    roofline_frac: float  # dsquant_gbs / 4.25 TB/s
    peer_gbs: float  # bf16 active bytes / peer graph time
    align_triton_us: float  # moe_align alone, graph replays, each implementation
    align_torch_us: float
    rel_err_vs_peer: float
    config: str


def build_layer(fmt: str, dense, device):
    """dense = (w13 [E, 2I, H], w2 [E, H, I], shared gate_up [2*2I, H], shared down [H, 2I]) bf16
    -> MoeWeights with the shared experts stacked after the routed ones."""
    import torch

    from dsquant.formats import awq_gemm, fp8_block, int_grid
    from dsquant.runtime.kernels.moe.fused_moe import MoeWeights, bf16_experts, split_shared_experts
    from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts
    from dsquant.runtime.kernels.moe.fused_moe_int4 import int4_experts_from_awq

    w13, w2, sgu, sd = dense
    s13, s2 = split_shared_experts(sgu, sd, N_SHARED)
    all13, all2 = torch.cat([w13, s13]), torch.cat([w2, s2])  # [E+2, 2I, H], [E+2, H, I]

    def convert(w):
        if fmt == "bf16":
            return bf16_experts(w)
        if fmt == "int4":
            parts = [awq_gemm.to_awq_tensors(*int_grid.quantize_int_groupwise(w[e].float(), 128), dtype=w.dtype)
                     for e in range(w.shape[0])]
            return int4_experts_from_awq(*[torch.stack([p[i] for p in parts]) for i in range(3)], 128)
        parts = [fp8_block.quantize_fp8_block(w[e]) for e in range(w.shape[0])]
        return fp8_experts(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))

    return MoeWeights(convert(all13), convert(all2))


def peer_plan(topk_weights, topk_ids):
    """Per expert hit: (expert, token indices, weights [n_e, 1] fp32), as transformers builds them."""
    import torch

    plan = []
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        plan.append((e, token, topk_weights[token, slot].unsqueeze(-1)))
    return plan


def peer_layer(x, dense, plan):
    """transformers' DeepseekV2Moe forward (experts loop + shared MLP), bf16."""
    import torch
    import torch.nn.functional as F

    w13, w2, sgu, sd = dense
    out = torch.zeros_like(x)
    for e, token, weight in plan:
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weight
        out.index_add_(0, token, y.to(out.dtype))
    sg, su = sgu.chunk(2, dim=0)
    return out + F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)


def expert_bytes(weights) -> list[int]:
    """Bytes of each expert's tensors (weight + scales + zeros, both projections)."""
    total = [0] * weights.num_experts
    for g in (weights.w13, weights.w2):
        for t in (g.weight, g.scales, g.zeros):
            if t is not None:
                per = t[0].numel() * t.element_size()
                total = [b + per for b in total]
    return total


def _random_dense(device, gen):
    import torch

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).to(torch.bfloat16)
    return rnd(E, 2 * I, H), rnd(E, H, I), rnd(2 * N_SHARED * I, H), rnd(H, N_SHARED * I)


def _routing(t, device, gen):
    import torch

    from dsquant.models.routing import RoutingConfig, route
    from dsquant.runtime.kernels.moe.fused_moe import with_shared_experts

    x = torch.randn(t, H, generator=gen, device=device).to(torch.bfloat16)
    gate = torch.randn(E, H, generator=gen, device=device) / H ** 0.5
    tw, ids = route(x, gate, RoutingConfig(E, TOP_K, "softmax", "greedy"))
    return x, tw, ids, with_shared_experts(tw, ids, E, N_SHARED)


def _sweep_rows(fmt, t, layers, routing, time_graph):
    """Each grouped GEMM at every SWEEP config (fp8: on activations quantized beforehand, so the
    quantize launch is not in the time; the fp8 GEMV rows include their in-kernel quantization)."""
    import torch

    from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8
    from dsquant.runtime.kernels.moe.moe_align import moe_align_block_size
    from dsquant.runtime.kernels.moe.moe_gemm import GemmConfig, moe_gemm

    rows = []
    for cfg in [GemmConfig(*c) for c in SWEEP]:
        times = []
        for gated in (True, False):
            args = []
            for w, (x, _, _, (tw8, ids8)) in zip(layers, routing):
                align = moe_align_block_size(ids8, w.num_experts, cfg.block_m)
                a = x if gated else torch.randn(ids8.numel(), I, device=x.device, dtype=x.dtype)
                out = torch.empty(ids8.numel(), I if gated else H, device=x.device, dtype=x.dtype)
                a, a_s = quantize_act_fp8(a) if fmt == "fp8" else (a, None)
                args.append((a, a_s, w.w13 if gated else w.w2, align, out, tw8))

            def run(args=args, gated=gated):
                for a, a_s, w, align, out, tw8 in args:
                    moe_gemm(a, w, align, out, cfg, a_row_div=TOP_K + N_SHARED if gated else 1, gated=gated,
                             topk_weights=None if gated else tw8, a_scale=a_s)
            try:
                times.append(time_graph(run) / len(args))
            except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                times.append(float("nan"))
                click.echo(f"  sweep {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
        rows.append({"format": fmt, "tokens": t, "config": str(cfg), "gate_up_us": times[0], "down_us": times[1]})
        click.echo(f"  sweep {fmt} T={t} {cfg}: gate/up {times[0]:.1f} us, down {times[1]:.1f} us")
    if fmt in ("int4", "fp8"):
        rows += _sweep_gemv_rows(fmt, t, layers, routing, time_graph)
    return rows


GEMV_SWEEP = [(8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (64, 4)]  # (block_n, num_warps)
GEMV_SPLITS = [1, 2, 4, 8, None]  # split_k; None = moe_gemv.default_split_k ("auto")


def _sweep_gemv_rows(fmt, t, layers, routing, time_graph):
    """The per-pair GEMV of `fmt` (moe_gemv.py / moe_gemv_fp8.py) at every GEMV_SWEEP x
    GEMV_SPLITS config, whatever the pair count; then the fastest config per projection."""
    import torch

    from dsquant.runtime.kernels.moe.moe_gemv import default_split_k, effective_split, moe_gemv_int4
    from dsquant.runtime.kernels.moe.moe_gemv_fp8 import moe_gemv_fp8

    from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8

    pairs = t * (TOP_K + N_SHARED)
    rows = []
    # FP8 also in moe_gemv_fp8's elementwise form on an activation quantized once (the quant inside the timing)
    variants = [("gemv", False)] + ([("gemv_elementwise_prequant", True)] if fmt == "fp8" else [])
    def fp8_elementwise_prequant(a, w, ids8, out, **kw):
        aq, a_s = per_token_group_quant_fp8(a, 128)
        return moe_gemv_fp8(aq, w, ids8, out, a_scale=a_s, elementwise=True, **kw)

    for (block_n, warps), split, (kernel, elt) in [(c, s, v) for c in GEMV_SWEEP for s in GEMV_SPLITS
                                                    for v in variants]:
        gemv = moe_gemv_int4 if fmt == "int4" else fp8_elementwise_prequant if elt else moe_gemv_fp8
        times, used = [], []
        for gated in (True, False):
            n_out, k = (I, H) if gated else (H, I)
            used.append(effective_split(split, k // 128) if split else default_split_k(pairs, n_out, k, block_n))
            args = []
            for w, (x, _, _, (tw8, ids8)) in zip(layers, routing):
                a = x if gated else torch.randn(ids8.numel(), I, device=x.device, dtype=x.dtype)
                out = torch.empty(ids8.numel(), n_out, device=x.device, dtype=x.dtype)
                args.append((a, w.w13 if gated else w.w2, ids8.contiguous(), out, tw8))

            def run(args=args, gated=gated):
                for a, w, ids8, out, tw8 in args:
                    gemv(a, w, ids8, out, a_row_div=TOP_K + N_SHARED if gated else 1, gated=gated,
                         topk_weights=None if gated else tw8, block_n=block_n, num_warps=warps, split_k=split)
            try:
                times.append(time_graph(run) / len(args))
            except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                times.append(float("nan"))
                click.echo(f"  gemv sweep {block_n}/{warps}/{split}: {type(exc).__name__}: {str(exc)[:120]}")
        label = split if split else "auto"
        cfg = f"{kernel}(block_n={block_n}, num_warps={warps}, split_k={label})"
        rows.append({"format": fmt, "tokens": t, "config": cfg, "kernel": kernel, "block_n": block_n,
                     "num_warps": warps, "split_k": label, "split_k_gate_up": used[0], "split_k_down": used[1],
                     "gate_up_us": times[0], "down_us": times[1]})
        click.echo(f"  sweep {fmt} T={t} {cfg}: gate/up {times[0]:.1f} us (split {used[0]}), "
                   f"down {times[1]:.1f} us (split {used[1]})")
    for key in ("gate_up_us", "down_us"):
        timed = [r for r in rows if r[key] == r[key]]  # not NaN
        if timed:
            best = min(timed, key=lambda r: r[key])
            click.echo(f"  best {fmt} T={t} {key[:-3]}: {best['config']} {best[key]:.1f} us")
    return rows


@click.command("moe", short_help="Fused MoE (BF16/INT4/FP8) vs a loop over experts (GPU).")
@click.option("--json", "json_path", default=None, help="Write the rows and environment here.")
@click.option("--tokens", default="1,8,64,512,4096", show_default=True, help="Comma-separated token counts.")
@click.option("--formats", "fmts", default="bf16,int4,fp8", show_default=True,
              help="Comma-separated expert weight formats (bf16, int4, fp8).")
@click.option("--layers", default=4, show_default=True, help="Weight copies cycled per timed call.")
@click.option("--sweep", "sweep_fmts", default="", help="Formats whose GEMMs to time over SWEEP configs.")
@click.option("--sweep-tokens", default="1,8,64", show_default=True, help="Token counts of the --sweep runs.")
def moe(json_path, tokens, fmts, layers, sweep_fmts, sweep_tokens):
    """Fused MoE (BF16/INT4/FP8) vs a bf16 loop over experts, DeepSeek-V2-Lite layer."""
    import torch
    import triton.testing as tt

    from dsquant.bench.common import time_graph_and_eager, write_json
    from dsquant.runtime.kernels.moe.fused_moe import ONE_BLOCK_PER_PAIR_MAX_TOKENS, fused_moe, pick_configs
    from dsquant.runtime.kernels.moe.moe_align import moe_align_block_size
    from dsquant.runtime.kernels.moe.moe_gemv import MOE_GEMV_MAX_PAIRS

    if not torch.cuda.is_available():
        raise click.ClickException("dsquant bench moe needs a CUDA GPU")
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    dense = [_random_dense(dev, gen) for _ in range(layers)]
    token_list = [int(v) for v in tokens.split(",")]
    sweep_list = [int(v) for v in sweep_tokens.split(",")] if sweep_fmts else []
    routing = {t: [_routing(t, dev, gen) for _ in range(layers)] for t in token_list + sweep_list}
    peers = {}
    for t in token_list:
        plans = [peer_plan(tw, ids) for _, tw, ids, _ in routing[t]]
        ref = [peer_layer(r[0], d, p) for r, d, p in zip(routing[t], dense, plans)]
        fn = lambda d=dense, r=routing[t], p=plans: [peer_layer(x[0], w, pl) for x, w, pl in zip(r, d, p)]  # noqa
        graph, eager = time_graph_and_eager(fn)
        peers[t] = (graph / layers, eager / layers, ref)
        click.echo(f"peer T={t}: graph {graph / layers:.1f} us, eager {eager / layers:.1f} us")
    rows, sweep = [], []
    for fmt in fmts.split(","):
        weights = [build_layer(fmt, d, dev) for d in dense]
        per_expert = expert_bytes(weights[0])
        bf16_bytes = expert_bytes(build_layer("bf16", dense[0], dev)) if fmt != "bf16" else per_expert
        for t in token_list:
            r = routing[t]
            fn = lambda w=weights, r=r: [fused_moe(x[0], wl, *x[3]) for x, wl in zip(r, w)]  # noqa
            outs = fn()
            graph, eager = (v / layers for v in time_graph_and_eager(fn))
            cfg13, _ = pick_configs(t * (TOP_K + N_SHARED), E + N_SHARED, fmt)
            path = ("gemv" if fmt == "int4" and t * (TOP_K + N_SHARED) <= MOE_GEMV_MAX_PAIRS
                    else f"pair blocks {cfg13}" if t <= ONE_BLOCK_PER_PAIR_MAX_TOKENS else str(cfg13))
            align_us = []
            for method in ("triton", "torch"):
                align_fn = lambda r=r, bm=cfg13.block_m, m=method: [  # noqa: E731
                    moe_align_block_size(x[3][1], E + N_SHARED, bm, method=m) for x in r]
                align_us.append(tt.do_bench_cudagraph(align_fn, rep=50, return_mode="median") * 1e3 / layers)
            hit = [torch.unique(x[3][1]).tolist() for x in r]
            active = sum(sum(per_expert[e] for e in h) for h in hit) / layers
            active_bf16 = sum(sum(bf16_bytes[e] for e in h) for h in hit) / layers
            p_graph, p_eager, ref = peers[t]
            err = max(float((o.float() - p.float()).norm() / p.float().norm()) for o, p in zip(outs, ref))
            gbs = active / graph / 1e3
            rows.append(Row(fmt, t, graph, eager, p_graph, p_eager, p_graph / graph, p_eager / eager,
                            sum(map(len, hit)) / layers, active / 1e6, gbs, gbs / ROOFLINE_GBS,
                            active_bf16 / p_graph / 1e3, *align_us, err, path))
            click.echo(f"{fmt:5s} T={t:5d}: graph {graph:8.1f} us (peer {p_graph:8.1f}, x{p_graph / graph:5.2f}) "
                       f"eager {eager:8.1f} us (peer {p_eager:8.1f}, x{p_eager / eager:5.2f}) "
                       f"{gbs:7.0f} GB/s = {gbs / ROOFLINE_GBS:5.1%} of roofline, align {align_us[0]:.1f}/{align_us[1]:.1f} us, "
                       f"err {err:.3f}")
        if fmt in sweep_fmts.split(","):
            for t in sweep_list:
                sweep += _sweep_rows(fmt, t, weights, routing[t],
                                     lambda f: tt.do_bench_cudagraph(f, rep=30, return_mode="median") * 1e3)
        del weights
        torch.cuda.empty_cache()
    write_json(json_path, rows, {"layer": dict(experts=E, shared=N_SHARED, top_k=TOP_K, hidden=H,
                                               moe_intermediate=I, layers_cycled=layers), "sweep": sweep})
