"""Issue 20 diagnosis: which module groups' AWQ moves dsq-tiny-v3's perplexity, against RTN.

Each variant is awq-w4g128 with some module groups left at RTN g128 (or one AWQ option changed),
quantized on CPU and scored at test_accuracy_bundled's settings (calibration 32 x 512 at --seed,
12288 evaluation tokens, window 512, stride 256). One JSON line per variant.

    python scripts/awq_scope_diag.py [--seed 0] [--n-samples 32] [--calib-source austen] [VARIANT ...]   # default: all

--calib-source keeps only the bundled calibration documents of that source (python-docs, cpython-3.11,
world-english-bible, austen): whether a method's loss on one eval set is the calibration mix's domain.
Variants "rtn" and "gptq" run the bundled rtn-w4g128 / gptq-w4g128 recipes beside the AWQ ones.
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dsquant.assets import bundled_model_path
from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.data import eval_tokens, sliding_window_perplexity
from dsquant.data.tokenizer import load_tokenizer
from dsquant.models import load_model

AWQ = "awq: {grid: 20, duo_scaling: true, clip: %s, clip_grid: 20, max_shrink: 0.5%s}"
KEEP = 'keep: [lm_head, "*.embed_tokens", "*.mlp.gate", "*norm"]'
VARIANTS = {  # name -> (module patterns left at RTN, clip, extra AWQ options)
    "awq": ((), "true", ""),
    "rtn-mlp": (("*.mlp.*",), "true", ""),
    "rtn-attn": (("*.self_attn.*",), "true", ""),
    "rtn-experts": (("*.mlp.experts.*",), "true", ""),
    "rtn-shared": (("*.mlp.shared_experts.*",), "true", ""),
    "no-clip": ((), "false", ""),
    "member-loss": ((), "true", ", block_loss: false"),
    "inspect8": ((), "true", ", inspect_samples: 8"),  # the layer-output loss on 8 / 16 / 32 sequences
    "inspect16": ((), "true", ", inspect_samples: 16"),
    "inspect32": ((), "true", ", inspect_samples: 32"),
    "no-duo": ((), "true", ", duo_scaling: false"),  # scales from the activations alone (s = x_mean^a)
    "grid40": ((), "true", ", grid: 40"),
}


BUNDLED = {"rtn": "rtn-w4g128", "gptq": "gptq-w4g128"}


def calib_subset(source: str, out: Path) -> Path:
    """The bundled calibration documents whose source starts with `source`, as JSON lines of text."""
    data = Path(__file__).resolve().parents[1] / "dsquant" / "assets" / "data" / "calibration.jsonl.xz"
    with lzma.open(data, "rt") as f:
        docs = [d for d in map(json.loads, f) if d["source"].split(":")[-1].startswith(source)]
    if not docs:
        raise SystemExit(f"{data}: no calibration document of source {source!r}")
    out.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in docs))
    return out


def recipe_yaml(name: str) -> str:
    rtn, clip, extra = VARIANTS[name]
    rules = "".join(f'  - {{match: "{p}", scheme: rtn, bits: 4, group_size: 128}}\n' for p in rtn)
    return (f"name: diag-{name}\ndefault: {{scheme: awq, bits: 4, group_size: 128}}\n"
            + (f"rules:\n{rules}" if rules else "") + f"{KEEP}\n" + AWQ % (clip, extra) + "\n")


def perplexities(model_dir, tokenizer) -> dict[str, float]:
    model = load_model(model_dir, dtype=torch.float32)
    out = {}
    for name in ("eval_prose", "eval_code"):
        tokens = eval_tokens(tokenizer, name, max_tokens=12288)
        out[name] = round(sliding_window_perplexity(lambda ids: model(ids), tokens, 512, 256).value, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-source", default=None, help="calibrate on this source's documents only")
    ap.add_argument("--n-samples", type=int, default=32, help="calibration sequences (dsquant quantize's default: 128)")
    args = ap.parse_args()
    base = bundled_model_path("dsq-tiny-v3")
    tokenizer = load_tokenizer(base)
    with tempfile.TemporaryDirectory() as tmp:
        calib = str(calib_subset(args.calib_source, Path(tmp) / "calib.jsonl")) if args.calib_source else None
        for name in args.variants:
            t0 = time.time()
            if name in BUNDLED:
                recipe = BUNDLED[name]
            else:
                recipe = Path(tmp) / f"{name}.yaml"
                recipe.write_text(recipe_yaml(name))
            report = run_quantize(QuantizeArgs(str(base), str(recipe), str(Path(tmp) / name), calib=calib,
                                               n_samples=args.n_samples, seqlen=512, seed=args.seed))
            print(json.dumps({"variant": name, "seed": args.seed, "n_samples": args.n_samples,
                              "calib_source": args.calib_source,
                              **perplexities(report.out_dir, tokenizer), "s": round(time.time() - t0)}), flush=True)


if __name__ == "__main__":
    main()
