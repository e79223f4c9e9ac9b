"""GPU probe: moe_align's three methods ("triton" one-hot, "sort", "torch") at decode and small-prefill
pair counts, CUDA-graph medians, outputs compared to the "torch" method's.

    python scripts/moe_align_probe.py OUT.json [--tokens 1,8,16,32,64,128,256]

Shapes: V2-Lite (64 routed + 2 shared experts, 8 pairs a token) and V3 (256 + 1 shared, 9 pairs a
token), at block_m 16 and 64 (fused_moe's small and large grouped tiles). One JSON row per case.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton.testing as tt

from dsquant.bench.common import environment
from dsquant.runtime.kernels.moe.moe_align import SORT_MAX_PAIRS, TRITON_MAX_PAIRS, moe_align_block_size

SHAPES = {"v2-lite": (66, 8), "v3": (257, 9)}  # experts (shared folded in), pairs a token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,8,16,32,64,128,256")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = [{"env": environment()}]
    for name, (e, k) in SHAPES.items():
        for t in map(int, args.tokens.split(",")):
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int().cuda()
            for block_m in (16, 64):
                ref = moe_align_block_size(ids, e, block_m, method="torch")
                r = {"shape": name, "tokens": t, "pairs": t * k, "block_m": block_m}
                for method in ("triton", "sort", "torch"):
                    if (method == "triton" and t * k > TRITON_MAX_PAIRS) or (method == "sort" and t * k > SORT_MAX_PAIRS):
                        continue
                    out = moe_align_block_size(ids, e, block_m, method=method)
                    r[f"{method}_same"] = all(torch.equal(a, b) for a, b in (
                        (out.sorted_token_ids, ref.sorted_token_ids), (out.expert_ids, ref.expert_ids),
                        (out.num_tokens_post_padded, ref.num_tokens_post_padded)))
                    r[f"{method}_us"] = tt.do_bench_cudagraph(
                        lambda: moe_align_block_size(ids, e, block_m, out=out, method=method), rep=50,
                        return_mode="median") * 1e3
                rows.append(r)
                print(json.dumps(r), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
