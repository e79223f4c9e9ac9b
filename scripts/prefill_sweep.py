"""GQA prefill (issue 23: >= 0.9x SDPA) on the GPU: `bench attention`'s prefill row over launch configs.

    PYTHONPATH=. python scripts/prefill_sweep.py OUT.json

B=4 Hq=32 Hkv=8 L=4096 D=128 causal (bench attention's shape) at block size 64 (its default) and 16
(the engine's), plus B=1 L=16384: dsquant's paged kernel against F.scaled_dot_product_attention
(is_causal, enable_gqa) measured in the same run on the same values, CUDA-graph medians, and the
fastest of bench attention's PREFILL_SWEEP configs (block_m, block_n, num_warps, num_stages).
"""
import dataclasses
import json
import sys

import torch

from dsquant.bench.attention import _gqa_prefill


def main(path):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, length, bs in ((4, 4096, 64), (4, 4096, 16), (1, 16384, 16)):
        try:
            r = dataclasses.asdict(_gqa_prefill(batch, 32, 8, length, 128, bs, True, gen))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            r = {"shape": f"B={batch} L={length} bs={bs}", "error": repr(e)[:2000]}
        rows.append(r)
        print({k: v for k, v in r.items() if k != "sweep"}, flush=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1, default=str)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
