"""GPU probe: the router's logits and routing in one launch (router_gemv.router_route) against two
(router_logits, then moe_route), at V2-Lite's and V3's router shapes, graph-replay medians.

    python scripts/router_route_probe.py OUT.json [--tokens 1,2,8,16] [--layers 26]

`--layers` router weights are cycled inside one CUDA graph (one per decoder layer, as a decode step
runs them); each row is µs per router call, with the two forms' outputs compared bit for bit.
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
from dsquant.runtime.kernels.moe.moe_route import moe_route
from dsquant.runtime.kernels.moe.router_gemv import ROUTER_GEMV_MAX_T, router_logits, router_route

# name: (E, H, top_k, scoring, method, n_group, topk_group, norm, scale, n_shared)
SHAPES = {"v2-lite": (64, 2048, 6, "softmax", "greedy", 1, 1, False, 1.0, 2),
          "v3": (256, 7168, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2,8,16")
    ap.add_argument("--layers", type=int, default=26)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (e, h, k, scoring, method, n_group, topk_group, norm, scale, n_shared) in SHAPES.items():
        ws = [(torch.randn(e, h, device="cuda", generator=gen) * 0.05).bfloat16() for _ in range(args.layers)]
        bias = torch.randn(e, device="cuda", generator=gen) * 0.5 if method == "noaux_tc" else None
        route_args = (k, scoring, method, n_group, topk_group, norm, scale, bias)
        counters = [torch.zeros(ROUTER_GEMV_MAX_T, dtype=torch.int32, device="cuda") for _ in ws]
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
            def two(x=x):
                return [moe_route(router_logits(x, w), *route_args, n_shared=n_shared) for w in ws]

            def one(x=x):
                return [router_route(x, w, c, *route_args, n_shared=n_shared) for w, c in zip(ws, counters)]

            same = all(torch.equal(a, b) for pa, pb in zip(two(), one()) for a, b in zip(pa, pb))
            r = dict(shape=name, tokens=t, same_bits=same)
            for form, fn in (("two_launches", two), ("one_launch", one)):
                r[f"{form}_us"] = tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3 / len(ws)
            r["speedup"] = r["two_launches_us"] / r["one_launch_us"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
