"""`dsquant quantize --scheme ...`: llm-compressor preset names, --format, --max-shard-size, --ignore and
the calibration column / split (CPU, the bundled dsq-tiny-qwen2, tiny calibration)."""
import json

import pytest
from safetensors import safe_open

from dsquant.calibrate.cli_quantize import parse_size
from dsquant.calibrate.export_format import choose_format
from dsquant.calibrate.presets import preset_recipe
from dsquant.calibrate.recipe import load_recipe
from dsquant.cli import main
from dsquant.errors import ConfigError, DsquantError


def run_main(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_presets_build_the_recipes_yaml_would():
    for scheme, algorithm, bundled in (("W4A16_ASYM", None, "awq-w4g128"), ("W4A16_ASYM", "rtn", "rtn-w4g128"),
                                       ("FP8_BLOCK", None, "fp8-block")):
        got, want = preset_recipe(scheme, algorithm).to_dict(), load_recipe(bundled).to_dict()
        assert {**got, "name": ""} == {**want, "name": ""}, scheme
    w4a16 = preset_recipe("w4a16", group_size=64, ignore=["*.self_attn.o_proj"])
    assert (w4a16.default.scheme, w4a16.default.group_size, w4a16.gptq.sym) == ("gptq", 64, True)
    assert w4a16.scheme_for("model.layers.0.self_attn.o_proj").scheme == "bf16"
    assert preset_recipe("W4A16_ASYM", "gptq").gptq.sym is False


@pytest.mark.parametrize("kwargs, message", [
    ({"scheme": "W4A16", "algorithm": "awq"}, "use --scheme W4A16_ASYM --algorithm awq"),
    ({"scheme": "FP8_DYNAMIC"}, "FP8_BLOCK is dsquant's FP8; expected one of W4A16, W4A16_ASYM, FP8_BLOCK"),
    ({"scheme": "W3A16"}, "--scheme W3A16: unknown scheme; expected one of W4A16, W4A16_ASYM, FP8_BLOCK"),
    ({"scheme": "W4A16", "group_size": 48}, "--group-size 48: expected one of 32, 64, 128"),
    ({"scheme": "FP8_BLOCK", "algorithm": "gptq"}, "--scheme FP8_BLOCK takes --algorithm rtn"),
])
def test_preset_errors_name_the_flag_and_the_valid_values(kwargs, message):
    with pytest.raises(ConfigError) as err:
        preset_recipe(**kwargs)
    assert message in str(err.value)


def test_parse_size_reads_sizes_as_transformers_does():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8
    assert parse_size("5Gb") == 5 * 10**9 // 8 and parse_size("1.5KiB") == 1536 and parse_size("1000") == 1000
    assert parse_size(None) is None
    with pytest.raises(DsquantError, match="--max-shard-size 5 parsecs: expected a size such as 5GB"):
        parse_size("5 parsecs")


def test_choose_format():
    awq, gptq = preset_recipe("W4A16_ASYM"), preset_recipe("W4A16")
    assert choose_format(awq, None) == "awq" and choose_format(awq, "compressed-tensors") == "compressed-tensors"
    assert choose_format(gptq, "auto") == "gptq" and choose_format(load_recipe("mixed-fp8attn-w4experts"), None) \
        == "compressed-tensors"
    with pytest.raises(ConfigError, match="--format awq: not available .* one of auto, gptq, compressed-tensors"):
        choose_format(gptq, "awq")


@pytest.mark.parametrize("args, message", [
    (["--format", "awq", "--scheme", "W4A16"], "--format awq: not available"),
    (["--scheme", "W4A16", "--recipe", "awq-w4g128"], "either --recipe"),
    ([], "either --recipe"),
    (["--recipe", "awq-w4g128", "--group-size", "64"], "--group-size goes with --scheme"),
    (["--scheme", "W4A16", "--calib-split", "train"], "--calib-split need --calib"),
    (["--scheme", "W4A16", "--max-shard-size", "lots"], "--max-shard-size lots: expected a size"),
    (["--scheme", "W4A16", "--format", "exl2"], "'exl2' is not one of 'auto', 'awq', 'gptq', 'fp8'"),
])
def test_quantize_flag_errors_exit_2_before_any_work(capsys, tmp_path, args, message):
    code, _, err = run_main(capsys, ["quantize", "dsq-tiny-qwen2", "-o", str(tmp_path / "out"), "--device", "cpu",
                                     *args])
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_quantize_scheme_run_with_every_option(capsys, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"body": f"line {i} of some calibration text, words and more words."}) + "\n"
                             for i in range(40)))
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, [
        "quantize", "dsq-tiny-qwen2", "--scheme", "W4A16_ASYM", "--algorithm", "rtn", "--ignore", "*.mlp.down_proj",
        "--format", "compressed-tensors", "--max-shard-size", "300KB", "--calib", str(calib),
        "--calib-column", "body", "--n-samples", "1", "--seqlen", "16", "--device", "cpu", "-o", str(out)])
    assert code == 0, err
    assert "recipe w4a16-asym-rtn-g128 -> format compressed-tensors" in stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert any(f.endswith("-002.safetensors") for f in files), files  # a layer over 300 KB was split
    for f in files:
        with safe_open(str(out / f), "pt") as st:
            keys = list(st.keys())
        assert (out / f).stat().st_size <= 300_000 or len(keys) == 1
    assert "model.layers.0.mlp.down_proj.weight" in index  # ignored: stays BF16
    assert "model.layers.0.mlp.up_proj.weight_packed" in index
    manifest = json.loads((out / "dsquant.json").read_text())
    assert manifest["calibration"]["column"] == "body" and set(manifest["shards"]) == set(files)
    code, stdout, err = run_main(capsys, ["inspect", str(out)])  # every tensor checked against config.json
    assert code == 0, err


def test_calibration_column_and_split_of_a_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    from dsquant.data.sources import load_documents

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": ["train text"]}),
                               "validation": datasets.Dataset.from_dict({"content": ["held out text"]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    assert load_documents(tmp_path / "ds", column="content", split="validation") == ["held out text"]
    assert load_documents(tmp_path / "ds", column="content") == ["train text"]
    with pytest.raises(DsquantError, match=r"no split 'test' \(splits: train, validation\)"):
        load_documents(tmp_path / "ds", column="content", split="test")
    with pytest.raises(DsquantError, match=r"no 'text' column \(found columns: content\)"):
        load_documents(tmp_path / "ds")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DsquantError, match="a single file has no splits"):
        load_documents(tmp_path / "a.jsonl", split="train")
