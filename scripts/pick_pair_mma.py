"""Print the EXTRA_PY statement (scripts/gpu.sh engineon) that switches fused_moe's INT4 decode to the
pair MMA at the fastest config per projection at one token in a moe_gemv_probe.py JSON (--kernels pair).

    python scripts/pick_pair_mma.py PROBE.json [--tokens 1]
"""
import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args()
    rows = [r for r in json.load(open(args.probe))["rows"]
            if r.get("kernel") == "pair_mma" and r["tokens"] == args.tokens and r["rel_err"] < 2e-2]
    best = {}
    for r in rows:
        p = r["projection"]
        if p not in best or r["full_us"] < best[p]["full_us"]:
            best[p] = r
    if set(best) != {"gate_up", "down"}:
        print("pass  # no pair-MMA rows")
        return
    cfg = tuple((best[p]["block_n"], best[p]["warps"], best[p]["split_k"]) for p in ("gate_up", "down"))
    print(f"import dsquant.runtime.kernels.moe.fused_moe as fm2; fm2.MOE_PAIR_MMA = True; fm2.PAIR_MMA_CONFIGS = {cfg}")


if __name__ == "__main__":
    main()
