"""export/manifest.py assembles dsquant.json from explicit values: every field in its place, peaks the
largest of the run's and each layer's, fallbacks sorted, expert_tokens only for layers that have them,
every layer's module errors in one map; config.json's "dsquant" entry names the manifest."""
import json

from dsquant.export.manifest import (MANIFEST, CalibrationRecord, QuantizeRun, build_manifest, config_entry,
                                     module_errors, versions)

LAYERS = {
    "0": {"seconds": 1.5, "errors": {"model.layers.0.mlp.down_proj": 0.25}, "schemes": {},
          "fallback_experts": [], "expert_tokens": None, "peak_host_bytes": 10, "peak_device_bytes": 7},
    "1": {"seconds": 2.0, "errors": {"model.layers.1.mlp.experts.0.up_proj": 0.5}, "schemes": {},
          "fallback_experts": [3], "expert_tokens": {"n_experts": 4, "counts": [1, 2, 3, 0]},
          "peak_host_bytes": 30, "peak_device_bytes": 5},
}


def run(**kw) -> QuantizeRun:
    calibration = CalibrationRecord("bundled:calibration", "text", None, 4, 64, 0, "ab" * 32)
    base = dict(format="awq", recipe={"default": {"scheme": "awq"}}, source_model="/m", calibration=calibration,
                device="cpu", seconds_total=3.14159, resumed_from_layer=1, peak_host_bytes=20,
                scheme_fallbacks={"z.proj": {"from": "awq g128", "to": "bf16", "reason": "r"},
                                  "a.proj": {"from": "awq g128", "to": "awq g64", "reason": "r"}},
                layer_stats=LAYERS)
    return QuantizeRun(**{**base, **kw})


def test_manifest_fields_from_the_run():
    v = {**versions(), "dsquant": "9.9"}
    m = build_manifest(run(), v)
    assert list(m) == ["dsquant_version", "format", "recipe", "source_model", "calibration", "device",
                       "seconds_total", "resumed_from_layer", "peak_host_bytes", "peak_device_bytes",
                       "scheme_fallbacks", "layers", "module_errors", "versions"]
    assert m["dsquant_version"] == "9.9" and m["versions"] == v and m["format"] == "awq"
    assert m["calibration"] == {"source": "bundled:calibration", "column": "text", "split": None, "n_samples": 4,
                                "seqlen": 64, "seed": 0, "sha256": "ab" * 32}
    assert m["seconds_total"] == 3.142 and m["resumed_from_layer"] == 1
    assert (m["peak_host_bytes"], m["peak_device_bytes"]) == (30, 7)
    assert list(m["scheme_fallbacks"]) == ["a.proj", "z.proj"]
    assert m["layers"] == {"0": {"seconds": 1.5, "fallback_experts": []},
                           "1": {"seconds": 2.0, "fallback_experts": [3],
                                 "expert_tokens": {"n_experts": 4, "counts": [1, 2, 3, 0]}}}
    assert m["module_errors"] == module_errors(LAYERS) == {"model.layers.0.mlp.down_proj": 0.25,
                                                           "model.layers.1.mlp.experts.0.up_proj": 0.5}
    json.dumps(m)  # written as JSON


def test_the_run_peak_wins_when_larger_and_config_names_the_manifest():
    m = build_manifest(run(peak_host_bytes=99, layer_stats={}), versions())
    assert (m["peak_host_bytes"], m["peak_device_bytes"], m["module_errors"]) == (99, 0, {})
    assert config_entry({"dsquant": "1.2"}) == {"version": "1.2", "manifest": MANIFEST} and MANIFEST == "dsquant.json"
