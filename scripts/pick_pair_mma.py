"""Print the EXTRA_PY statement (scripts/gpu.sh engineon) that switches fused_moe's decode to the pair
MMA at the fastest config per projection at one token: INT4 from a moe_gemv_probe.py JSON (--kernels
pair), FP8 from a moe_pair_fp8_probe.py JSON (--fp8), only where it beats the probe's own grouped row.

    python scripts/pick_pair_mma.py PROBE.json [--tokens 1] [--fp8 FP8_PROBE.json]
"""
import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--fp8", help="a moe_pair_fp8_probe.py JSON")
    args = ap.parse_args()
    statements = [int4_statement(args.probe, args.tokens)]
    if args.fp8:
        statements.append(fp8_statement(args.fp8, args.tokens))
    print("; ".join(s for s in statements if s) or "pass")


def fp8_statement(path: str, tokens: int) -> str:
    rows = [r for r in json.load(open(path))["rows"] if r["tokens"] == tokens and r["rel_err"] < 5e-2]
    best = {}
    for r in rows:
        if r["kernel"] == "pair" and (r["projection"] not in best or r["us"] < best[r["projection"]]["us"]):
            best[r["projection"]] = r
    grouped = {r["projection"]: r["us"] for r in rows if r["kernel"] == "grouped"}
    if set(best) != {"gate_up", "down"} or sum(best[p]["us"] for p in best) >= sum(grouped.values()):
        return ""
    cfg = tuple((best[p]["block_n"], best[p]["warps"], best[p]["split_k"], best[p]["block_m"])
                for p in ("gate_up", "down"))
    return ("import dsquant.runtime.kernels.moe.fused_moe as fm3; fm3.MOE_PAIR_MMA_FP8 = True; "
            f"fm3.PAIR_FP8_CONFIGS = {cfg}")


def int4_statement(path: str, tokens: int) -> str:
    rows = [r for r in json.load(open(path))["rows"] if r["tokens"] == tokens]
    best = {}
    for r in rows:
        if r.get("kernel") == "pair_mma" and r["rel_err"] < 2e-2 and (
                r["projection"] not in best or r["full_us"] < best[r["projection"]]["full_us"]):
            best[r["projection"]] = r
    gemv = {r["projection"]: r["full_us"] for r in rows if r.get("kernel") == "gemv"}
    if set(best) != {"gate_up", "down"} or sum(best[p]["full_us"] for p in best) >= sum(gemv.values()):
        return ""
    cfg = tuple((best[p]["block_n"], best[p]["warps"], best[p]["split_k"]) for p in ("gate_up", "down"))
    return f"import dsquant.runtime.kernels.moe.fused_moe as fm2; fm2.MOE_PAIR_MMA = True; fm2.PAIR_MMA_CONFIGS = {cfg}"

if __name__ == "__main__":
    main()
