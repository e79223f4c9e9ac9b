"""MLA decode-layer sweep on the GPU (diagnostics for the engine's batch-1 decode).

    PYTHONPATH=. python scripts/mla_sweep.py OUT.json

V2-Lite's attention shapes (16 heads, nope 128, rope 64, R 512, v 128), bf16, block size 16.
1. The attention core of one layer, from the projections' outputs to o_proj's input, timed in a
   CUDA graph (20 layers back to back, like decode): the seven-launch chain (rope, kv RMSNorm,
   latent store, W_UK einsum, decode + merge, W_UV einsum) against mla_prepare + split decode +
   mla_merge_uv, at batch 1, 8, 64, context 600 / 4096 / 32768, max_seq_len = the context and
   = 163840 (what a CUDA graph captured for V2-Lite's max_model_len passes). Outputs compared.
2. The fused layer at batch 1 over num_splits x block_n x num_warps x num_stages.
"""
import json
import math
import sys

import torch

from dsquant.runtime.kernels.attention.kv_store import store_latent
from dsquant.runtime.kernels.attention.mla_absorb import MERGE_UV_MAX_ROWS, mla_merge_uv, mla_prepare
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_attention, mla_decode_split
from dsquant.runtime.kernels.ops.rmsnorm import rms_norm
from dsquant.runtime.kernels.ops.rope import apply_rope
from dsquant.runtime.kernels.attention.split_kv_merge import merge_splits

H, NOPE, ROPE, R, V, BS = 16, 128, 64, 512, 128, 16
dev, dt = "cuda", torch.bfloat16


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / (10 * reps))
    return best


def case(batch, ctx):
    g = torch.Generator(device=dev).manual_seed(batch * 7 + ctx)
    blocks_per = -(-(ctx + 1) // BS)
    cache = torch.randn(batch * blocks_per + 1, BS, R + ROPE, device=dev, dtype=dt, generator=g)
    table = torch.randperm(batch * blocks_per, device=dev, generator=g).view(batch, blocks_per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    slots = (table[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS)
    q = torch.randn(batch, H, NOPE + ROPE, device=dev, dtype=dt, generator=g)
    latent = torch.randn(batch, R + ROPE, device=dev, dtype=dt, generator=g)
    w_uk = (torch.randn(H, NOPE, R, device=dev, generator=g) / math.sqrt(NOPE)).to(dt)
    w_uv = (torch.randn(H, V, R, device=dev, generator=g) / math.sqrt(R)).to(dt)
    norm_w = (1 + 0.1 * torch.randn(R, device=dev, generator=g)).to(dt)
    ang = torch.rand(batch, ROPE // 2, device=dev, generator=g) * 6
    return dict(cache=cache, table=table, lens=lens, slots=slots, q=q, latent=latent, w_uk=w_uk, w_uv=w_uv,
                norm_w=norm_w, cos=ang.cos(), sin=ang.sin())


def chain(c, scale, max_len):
    q = c["q"].clone()
    q_nope, q_pe = q.split([NOPE, ROPE], -1)
    kv, k_pe = c["latent"].clone().split([R, ROPE], -1)
    apply_rope(None, q_pe, k_pe[:, None], c["cos"], c["sin"], layout="interleaved")
    kv = rms_norm(kv, c["norm_w"], 1e-6)
    store_latent(kv, k_pe, c["cache"], c["slots"])
    q_abs = torch.einsum("thn,hnr->thr", q_nope, c["w_uk"])
    lat = mla_decode_attention(q_abs, q_pe, c["cache"], c["table"], c["lens"], scale, max_seq_len=max_len)
    return torch.einsum("thr,hvr->thv", lat, c["w_uv"])


def fused(c, scale, max_len, config=MLADecodeConfig()):
    q = c["q"].clone()
    q_abs = mla_prepare(q, c["latent"], c["norm_w"], 1e-6, c["cos"], c["sin"], c["w_uk"], c["cache"], c["slots"], True)
    parts = mla_decode_split(q_abs, q[..., NOPE:], c["cache"], c["table"], c["lens"], scale, max_seq_len=max_len,
                             config=config)
    if parts is not None and q.shape[0] > MERGE_UV_MAX_ROWS:
        lat = torch.empty_like(q_abs)
        merge_splits(*parts, lat)
        return torch.einsum("thr,hvr->thv", lat, c["w_uv"])
    if parts is None:
        lat = mla_decode_attention(q_abs, q[..., NOPE:], c["cache"], c["table"], c["lens"], scale,
                                   max_seq_len=max_len, config=config)
        return torch.einsum("thr,hvr->thv", lat, c["w_uv"])
    return mla_merge_uv(*parts, c["w_uv"])


def main(path):
    scale = 1 / math.sqrt(NOPE + ROPE)
    rows, sweep = [], []
    for batch in (1, 8, 64):
        for ctx in (600, 4096, 32768):
            if batch * ctx > 64 * 4096 * 2:
                continue
            c = case(batch, ctx)
            for max_len in (ctx, 163840):
                a = chain(c, scale, max_len)
                b = fused(c, scale, max_len)
                err = ((a.float() - b.float()).norm() / a.float().norm()).item()
                r = {"batch": batch, "ctx": ctx, "max_seq_len": max_len, "rel_err": err,
                     "chain_us": graph_us(lambda: chain(c, scale, max_len)),
                     "fused_us": graph_us(lambda: fused(c, scale, max_len))}
                r["speedup"] = r["chain_us"] / r["fused_us"]
                rows.append(r)
                print(r, flush=True)
    for ctx in (600, 4096, 32768):
        c = case(1, ctx)
        for splits in (8, 16, 32, 64):
            for block_n in (32, 64):
                for warps in (4, 8):
                    for stages in (2, 3):
                        cfg = MLADecodeConfig(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages)
                        r = {"batch": 1, "ctx": ctx, "splits": splits, "block_n": block_n, "warps": warps,
                             "stages": stages, "fused_us": graph_us(lambda: fused(c, scale, 163840, cfg))}
                        sweep.append(r)
                        print(r, flush=True)
        with open(path, "w") as f:
            json.dump({"layer": rows, "splits": sweep}, f, indent=1)
    with open(path, "w") as f:
        json.dump({"layer": rows, "splits": sweep}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
