"""MLA decode at long context and small batch on the GPU (issue 23: decode at 128K <= 4 ms per token).

    PYTHONPATH=. python scripts/mla_long_sweep.py OUT.json [--budget-s 150]

V2-Lite's attention (16 heads, nope 128, rope 64, R 512, v 128), bf16, block size 16, pages at random.
At batch 1 and 2, contexts 600 to 131072, the decode-layer core as the engine's decode graph runs it
(mla_prepare + split decode + mla_merge_uv, max_seq_len 163840, i.e. the split count a graph captured
for V2-Lite's max_model_len uses whatever the context), timed in CUDA graphs (scripts/mla_sweep.graph_us):
the heuristic's plan and a few num_splits x block_n x num_warps x num_stages, each output against
64 splits', the latent read in GB/s.
"""
import argparse
import json
import math
import time

from dsquant.runtime.kernels.attention.mla_absorb import mla_merge_uv, mla_prepare
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_split
from dsquant.runtime.kernels.attention.mla_decode_plan import launch_plan
from scripts.mla_sweep import NOPE, R, ROPE, case, graph_us

MAX_LEN = 163840
# (splits, block_n, num_warps, num_stages); splits 0: the heuristic
CONFIGS = [(0, 32, 4, 2), (64, 32, 4, 2), (128, 32, 4, 2), (256, 32, 4, 2), (128, 64, 8, 2)]


def layer(c, scale, config: MLADecodeConfig):
    """mla_prepare + split decode + merge through W_UV -> [B, H, v] (the decode graph's layer core)."""
    q = c["q"].clone()
    q_abs = mla_prepare(q, c["latent"], c["norm_w"], 1e-6, c["cos"], c["sin"], c["w_uk"], c["cache"], c["slots"], True)
    parts = mla_decode_split(q_abs, q[..., NOPE:], c["cache"], c["table"], c["lens"], scale, max_seq_len=MAX_LEN,
                             config=config)
    return mla_merge_uv(*parts, c["w_uv"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    scale = 1 / math.sqrt(NOPE + ROPE)
    t0 = time.time()
    rows = []
    for batch, ctx in ((1, 131072), (1, 32768), (1, 4096), (1, 600), (2, 131072), (2, 32768), (4, 131072)):
        c = case(batch, ctx)
        heuristic = launch_plan(c["q"], c["cache"], MAX_LEN, MLADecodeConfig(), c["table"])[3]
        ref = layer(c, scale, MLADecodeConfig(num_splits=64)).float()
        gb = batch * ctx * (R + ROPE) * 2 / 1e9
        for splits, block_n, warps, stages in CONFIGS:
            if time.time() - t0 > args.budget_s:
                break
            cfg = MLADecodeConfig(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages)
            try:
                out = layer(c, scale, cfg).float()
                us = graph_us(lambda: layer(c, scale, cfg), reps=5)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is reported
                rows.append({"batch": batch, "ctx": ctx, "splits": splits, "error": repr(e)[:300]})
                continue
            r = {"batch": batch, "ctx": ctx, "splits": splits or heuristic, "heuristic": not splits,
                 "block_n": block_n, "warps": warps, "stages": stages,
                 "rel_err_vs_64": ((out - ref).norm() / ref.norm()).item(), "layer_us": us,
                 "layer_gbs": gb / us * 1e6}
            rows.append(r)
            print(r, flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
