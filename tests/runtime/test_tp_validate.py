"""`dsquant validate --tensor-parallel-size`: accuracy windows scored through a tensor-parallel engine
(validate/tp_accuracy.py, LLMEngine.window_logits) equal the one-process figures (CPU, gloo)."""
import json

import pytest
import torch
from click.testing import CliRunner

from dsquant.assets import bundled_model_path
from dsquant.errors import DsquantError



def test_window_logits_equal_the_runtime_models_full_forward_and_return_their_blocks():
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
    from dsquant.validate.runner import _runtime_model

    path = str(bundled_model_path("dsq-tiny-v3"))
    ids = torch.randint(0, 8000, (77,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = _runtime_model(path, "cpu")(torch.tensor([ids]))[0]  # [77, V]
    eng = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, max_model_len=96, num_blocks=8,
                                       max_num_seqs=1))
    free = eng.block_manager.num_free_blocks
    got = eng.window_logits(ids)
    assert got.shape == ref.shape and torch.allclose(got, ref, rtol=0, atol=1e-5)
    assert eng.block_manager.num_free_blocks == free
    with pytest.raises(DsquantError, match="1 to 96"):
        eng.window_logits(ids + ids)
    eng.add_request(ids[:5])
    with pytest.raises(DsquantError, match="idle"):
        eng.window_logits(ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_validate_at_tp2_gives_tp1s_perplexity_kl_and_top1(tmp_path, one_thread):
    """Issue 26: the bundled trained model and its RTN artifact through validate at TP = 2 and TP = 1."""
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.cli import cli

    base = str(bundled_model_path("dsq-tiny-v3"))
    art = tmp_path / "rtn"
    run_quantize(QuantizeArgs(base, "rtn-w4g128", str(art), n_samples=1, seqlen=128))
    reports = {}
    for tp in (1, 2):
        out = tmp_path / f"report{tp}"
        result = CliRunner().invoke(cli, ["validate", str(art), "--baseline", base, "--device", "cpu", "--no-latency",
                                           "--no-peers", "--window", "128", "--stride", "64", "--max-eval-tokens",
                                           "384", "--tensor-parallel-size", str(tp), "--out", str(out)])
        assert result.exit_code == 0, result.output
        reports[tp] = {row["name"]: row["accuracy"] for row in json.loads((out / "report.json").read_text())["rows"]}
    for name in ("baseline", "rtn"):
        for s in ("eval_prose", "eval_code"):
            one, two = reports[1][name][s], reports[2][name][s]
            assert two["perplexity"]["value"] == pytest.approx(one["perplexity"]["value"], rel=2e-3)  # the 0.2%
            assert two["perplexity"]["value"] == pytest.approx(one["perplexity"]["value"], rel=1e-4)  # fp32 sums
            if name == "rtn":
                assert two["kl_mean"]["value"] == pytest.approx(one["kl_mean"]["value"], rel=1e-3, abs=1e-6)
                assert two["top1_agreement"]["value"] == pytest.approx(one["top1_agreement"]["value"], abs=1e-3)


@pytest.mark.parametrize("extra,match", [(["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
                                         (["--lm-eval", "dsq_prose_cloze"], "--lm-eval"),
                                         (["-tp", "3"], "--tensor-parallel-size 3")])
def test_validate_refuses_what_it_does_not_combine_with_tp(extra, match):
    from dsquant.cli import cli

    base = str(bundled_model_path("dsq-tiny-v3"))
    result = CliRunner().invoke(cli, ["validate", base, "--baseline", base, "--device", "cpu", "--no-latency",
                                      "--no-peers", "-tp", "2", *extra])  # a second -tp overrides the first
    assert result.exit_code != 0 and match in str(result.exception or result.output)
