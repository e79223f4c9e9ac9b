"""dsquant's AWQ against llm-compressor's on the same model and the same calibration tokens.

    python scripts/compare_peer_awq.py --model dsq-tiny-qwen2 --peer-python /opt/llmc-venv/bin/python

1. draws the calibration tokens with dsquant (bundled set, seed 0) and writes them to a file;
2. runs scripts/peer_llmcompressor.py in llm-compressor's own virtualenv on those tokens;
3. quantizes with dsquant's awq-w4g128 recipe on the same tokens;
4. prints the perplexity of BF16, dsquant AWQ and llm-compressor AWQ on eval_prose and eval_code
   (the same windows for all three; llm-compressor's artifact is read through dsquant's loader).
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.assets import resolve_model_dir
from dsquant.data import calibration_samples, eval_tokens, sliding_window_perplexity
from dsquant.data.tokenizer import load_tokenizer
from dsquant.models import load_model


def perplexity(path, streams, window, stride) -> dict:
    model = load_model(path, dtype=torch.float32)
    return {s: sliding_window_perplexity(lambda ids: model(ids), t, window, stride).value for s, t in streams.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dsq-tiny-qwen2")
    ap.add_argument("--peer-python", required=True, help="python of llm-compressor's virtualenv")
    ap.add_argument("--work", default="peer-awq")
    ap.add_argument("--n-samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=12288)
    args = ap.parse_args()
    base = resolve_model_dir(args.model)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(base)
    tokens = work / "calib.safetensors"
    save_file({"input_ids": calibration_samples(tokenizer, args.n_samples, args.seqlen, 0)}, str(tokens))
    peer_out = work / "llmcompressor-awq"
    subprocess.run([args.peer_python, str(Path(__file__).with_name("peer_llmcompressor.py")), "--model", str(base),
                    "--tokens", str(tokens), "--out", str(peer_out)], check=True)
    ours = run_quantize(QuantizeArgs(str(base), "awq-w4g128", str(work / "dsquant-awq"), n_samples=args.n_samples,
                                     seqlen=args.seqlen, force=True)).out_dir
    streams = {s: eval_tokens(tokenizer, s, max_tokens=args.eval_tokens) for s in ("eval_prose", "eval_code")}
    rows = {"bf16": perplexity(base, streams, 512, 256), "dsquant awq-w4g128": perplexity(ours, streams, 512, 256),
            "llm-compressor AWQ W4A16_ASYM g128": perplexity(peer_out, streams, 512, 256)}
    print(f"| {args.model} | eval_prose | eval_code |\n| --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['eval_prose']:.3f} | {r['eval_code']:.3f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
