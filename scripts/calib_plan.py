"""The 671B calibration plan, measured (issue 24 item 3): quantize a DeepSeek-V3-shaped checkpoint of
one dense and one MoE layer, written as V3 ships (FP8 e4m3, 128 x 128 `weight_scale_inv` blocks),
with each recipe, and project the 61-layer model (3 dense + 58 MoE layers) from the per-layer times.

    python scripts/calib_plan.py OUT.json [--recipes awq-w4g128,gptq-w4g128,rtn-w4g128] [--small]

Each recipe runs as its own `dsquant quantize` process, so the manifest's peak host memory is that
recipe's. The input is read straight from FP8 (the loader dequantizes one layer at a time in memory);
the script checks that nothing but the artifact and its resume state (calibration activations) is
written: the bytes on disk after the run are compared with the artifact's tensors. `--small` runs
the same at a reduced shape (CPU smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsquant.bench.random_model import V3, write_random_checkpoint

FULL_LAYERS = {"dense": 3, "moe": 58}  # DeepSeek-V3 / R1: first_k_dense_replace 3 of 61 layers
SMALL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, v_head_dim=64,
             n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _tensor_bytes(art: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in art.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8}[sl.get_dtype()]
    return total


def quantize(src: Path, recipe: str, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "dsquant", "quantize", str(src), "--recipe", recipe, "-o", str(out),
           "--device", args.device, "--n-samples", str(args.n_samples), "--seqlen", str(args.seqlen)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t
    row = {"recipe": recipe, "rc": proc.returncode, "wall_s": round(wall, 1), "cmd": " ".join(cmd[1:])}
    if proc.returncode:
        row["stderr"] = proc.stderr[-2000:]
        return row
    m = json.loads((out / "dsquant.json").read_text())
    layers = {int(k): v["seconds"] for k, v in m["layers"].items()}
    row.update(layer_s=layers, seconds_total=m["seconds_total"], peak_device_gb=round(m["peak_device_bytes"] / 1e9, 2),
               peak_host_gb=round(m["peak_host_bytes"] / 1e9, 2), disk_bytes=_tree_bytes(out),
               tensor_bytes=_tensor_bytes(out), fallback_experts=m["layers"]["1"].get("fallback_experts"),
               expert_tokens=m["layers"]["1"].get("expert_tokens"), format=m.get("format"))
    # every byte on disk is the artifact's tensors, its JSON side files and the tokenizer: no BF16 copy
    row["non_tensor_bytes"] = row["disk_bytes"] - row["tensor_bytes"]
    dense_s, moe_s = layers[0], layers[1]
    other_s = wall - dense_s - moe_s  # start-up, embedding, lm_head, the top shard, finalizing
    full = FULL_LAYERS["dense"] * dense_s + FULL_LAYERS["moe"] * moe_s + other_s
    row["projected_61_layers_h"] = round(full / 3600, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_json")
    ap.add_argument("--recipes", default="awq-w4g128,gptq-w4g128,rtn-w4g128")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="calib_plan_"))
    config = {**V3, "num_hidden_layers": 2, "first_k_dense_replace": 1, **(SMALL if args.small else {})}
    src = work / "v3-2layer-fp8"
    t = time.perf_counter()
    if not (src / "model.safetensors.index.json").exists():
        write_random_checkpoint(src, config, device=args.device, scheme="fp8")
    report = {"config": {k: config[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                                "n_routed_experts", "num_experts_per_tok", "q_lora_rank",
                                                "kv_lora_rank", "num_attention_heads")},
              "write_s": round(time.perf_counter() - t, 1), "source_bytes": _tree_bytes(src),
              "n_samples": args.n_samples, "seqlen": args.seqlen, "rows": []}
    for recipe in args.recipes.split(","):
        row = quantize(src, recipe, work / recipe, args)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out_json).write_text(json.dumps(report, indent=1))
    hidden = config["hidden_size"]
    # calibration activations kept on the device: the layer's input and output, bf16 [n, T, hidden]
    report["activation_bytes_per_token"] = 2 * 2 * hidden
    Path(args.out_json).write_text(json.dumps(report, indent=1))
    os.sync()


if __name__ == "__main__":
    main()
