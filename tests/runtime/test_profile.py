"""`dsquant profile`: a Chrome trace and a time-by-layer-type table, on CPU with a bundled model."""
import json

import pytest
from click.testing import CliRunner
from torch import nn

from dsquant.cli import cli
from dsquant.runtime.profile import LAYER_TYPES, layer_type


def test_layer_type_mapping():
    assert layer_type("model.layers.0.self_attn.q_a_proj", nn.Linear(2, 2)) == "linear"
    assert layer_type("lm_head", nn.Linear(2, 2)) == "linear"
    assert layer_type("model.layers.0.input_layernorm", nn.Identity()) == "norm/residual"
    assert layer_type("model.layers.0.self_attn", nn.Identity()) == "attention"
    assert layer_type("model.layers.1.mlp", nn.Identity()) == "mlp/moe"
    assert layer_type("model.layers", nn.ModuleList()) is None


@pytest.mark.parametrize("model", ["dsq-tiny-v3"])
def test_profile_cpu_trace_and_table(tmp_path, model):
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", model, "--device", "cpu", "--prompt-len", "16",
                                   "--decode-steps", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert len(events) > 100
    names = {e.get("name") for e in events}
    assert {"dsq::prefill", "dsq::decode", "dsq::attention", "dsq::linear"} <= names
    summary = json.loads((out / "profile.json").read_text())
    for phase in ("prefill", "decode"):
        totals = summary["totals_us"][phase]
        assert set(totals) == set(LAYER_TYPES)
        for t in ("attention", "linear", "mlp/moe", "norm/residual", "sampler"):
            assert totals[t] > 0, (phase, t, totals)
    assert summary["kernels"] and all(k["time_us"] >= 0 for k in summary["kernels"])
    for t in LAYER_TYPES:  # one row per layer type in each phase's table
        assert res.output.count(f"\n{t} ") == 2, res.output
    assert "decode (3 steps)" in res.output and (out / "profile.md").is_file()
