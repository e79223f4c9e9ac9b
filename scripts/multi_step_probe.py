"""Multi-step decoding against single steps on one model: TPOT, throughput and the decode split (GPU).

python scripts/multi_step_probe.py OUT.json MODEL_DIR [MODEL_DIR ...] [--steps 1,8] [--rounds 2] [--batch 1,64]

Each round measures every (model, num_scheduler_steps) pair in turn with tune's LatencySpec
(validate.latency.measure_latency: a fresh engine each time, the decode split recorded), so a slow
spell of the machine falls on every pair. Prints per pair the medians over rounds: TPOT at batch 1,
output tokens/s at each larger batch, and per decode step the host's own work and the GPU time
(StepTimes.split: a burst's times divided by its steps).
"""
import argparse
import json
import statistics
from dataclasses import asdict

from dsquant.tune.runner import latency_spec
from dsquant.validate.latency import measure_latency


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--steps", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    runs: dict[str, list] = {}
    for r in range(args.rounds):
        for model in args.models:
            for n in steps:
                spec = latency_spec(batches, args.device, n)
                res = measure_latency(model, args.device, spec)
                key = f"{model} steps={n}"
                runs.setdefault(key, []).append(asdict(res))
                split = {b: {k: round(v, 1) for k, v in s.items()} for b, s in res.decode_split.items()}
                print(f"round {r} {key}: TPOT {res.tpot_s * 1e6:.1f} us, "
                      + ", ".join(f"b{b} {t:.0f} tok/s" for b, t in res.throughput_tok_s.items())
                      + f", split {split}", flush=True)
    summary = {}
    for key, rs in runs.items():
        summary[key] = {"tpot_us": statistics.median(x["tpot_s"] for x in rs) * 1e6,
                        "tok_s": {b: statistics.median(x["throughput_tok_s"][b] for x in rs)
                                  for b in rs[0]["throughput_tok_s"]},
                        "split": [x["decode_split"] for x in rs]}
        print(f"{key}: TPOT {summary[key]['tpot_us']:.1f} us, "
              + ", ".join(f"b{b} {t:.0f} tok/s" for b, t in summary[key]["tok_s"].items()))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
