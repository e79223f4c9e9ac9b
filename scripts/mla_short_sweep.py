"""MLA decode at short contexts: how finely to split a sequence (GPU probe for the engine's decode).

    PYTHONPATH=. python scripts/mla_short_sweep.py OUT.json [--batches 1,2,4,8] [--ctx 128,320,600,1024,2048,4096]

V2-Lite's attention (16 heads, nope 128, rope 64, R 512, v 128), bf16, block size 16, max_seq_len 163840
(what the engine's decode graph, captured at V2-Lite's max_model_len, passes). Times the layer core the
engine replays (mla_prepare + split decode + mla_merge_uv) as CUDA-graph replays over `--layers` distinct
layers (own caches and W_UK / W_UV, as in a decode step), per layer, for block_n x min_split_tiles (the
fewest BLOCK_N tiles a split covers: split_kv_merge.split_bounds), and checks each against the default
config's output. The question: at 600 tokens a split of 4 x 32 tokens leaves 5 programs each walking 4
dependent tiles; finer splits trade that chain for more partial results.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig
from mla_sweep import NOPE, ROPE, case, fused, graph_us  # noqa: E402

CONFIGS = [(32, 4), (32, 2), (32, 1), (16, 4), (16, 2), (16, 1), (64, 1), (32, 8), (32, 16)]  # (block_n, min_split_tiles); 8, 16: coarser splits for large batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--ctx", default="128,320,600,1024,2048,4096")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=163840)
    args = ap.parse_args()
    scale = 1 / math.sqrt(NOPE + ROPE)
    rows = []
    for batch in map(int, args.batches.split(",")):
        for ctx in map(int, args.ctx.split(",")):
            layers = [case(batch, ctx + 7 * i) for i in range(args.layers)]
            base = [fused(c, scale, args.max_seq_len) for c in layers]
            default_us = None
            for block_n, tiles in CONFIGS:
                cfg = MLADecodeConfig(block_n=block_n, min_split_tiles=tiles)
                fn = lambda cfg=cfg: [fused(c, scale, args.max_seq_len, cfg) for c in layers]  # noqa: E731
                err = max(float((o.float() - b.float()).norm() / b.float().norm()) for o, b in zip(fn(), base))
                us = graph_us(fn, reps=2) / args.layers
                default_us = us if (block_n, tiles) == (32, 4) else default_us
                r = {"batch": batch, "ctx": ctx, "block_n": block_n, "min_split_tiles": tiles, "us_per_layer": us,
                     "vs_default": default_us / us, "rel_err_vs_default": err}
                rows.append(r)
                print(f"B={batch} ctx={ctx:5d} block_n={block_n:2d} tiles={tiles} {us:6.2f} us/layer "
                      f"({r['vs_default']:.2f}x default) err {err:.1e}", flush=True)
            del layers, base
            torch.cuda.empty_cache()
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
