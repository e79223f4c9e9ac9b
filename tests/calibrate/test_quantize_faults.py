"""`dsquant quantize` under faults (issue 21, item 6): a full disk is one line and exit 2 with the
run left resumable, the free-space check counts the resume hidden states, a run that fails before
any progress leaves no OUT.partial, and a wrong num_hidden_layers is caught before the first layer."""
import json
import shutil

import pytest
import torch
from safetensors import SafetensorError

from dsquant.calibrate import pipeline
from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.errors import CheckpointError, DsquantError
from dsquant.export import writer as writer_mod
from dsquant.export.writer import HIDDEN, ArtifactWriter
from tests.tiny_checkpoints import write_tiny_v3

RECIPE = "rtn-w4g128"  # no calibration search: the fastest recipe


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    return write_tiny_v3(tmp_path_factory.mktemp("tiny_v3_faults"))


def args_for(model_dir, out) -> QuantizeArgs:
    return QuantizeArgs(str(model_dir), RECIPE, str(out), n_samples=4, seqlen=64)


def test_a_full_disk_is_one_line_exit_2_and_the_run_resumes(tiny_v3, tmp_path, monkeypatch, capsys):
    from dsquant.cli import main

    real, saves = writer_mod.save_file, []

    def save_file(tensors, path, metadata=None):
        if HIDDEN in path:
            saves.append(path)
            if len(saves) == 2:  # after layer 1: the disk is full
                open(path, "wb").write(b"partial")
                raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer_mod, "save_file", save_file)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", str(tiny_v3), "--recipe", RECIPE, "-o", str(out), "--n-samples", "4", "--seqlen", "64",
              "--device", "cpu"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]  # the rest: the progress bar
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    err = errors[0]
    hidden_bytes = 4 * 64 * 128 * 4  # [n_samples, seqlen, hidden] fp32
    assert f"{HIDDEN}.tmp" in err and f"{hidden_bytes} bytes" in err and "No space left" in err, err
    partial = tmp_path / "out.partial"
    assert json.loads((partial / "resume.json").read_text())["next_layer"] == 1
    assert not list(partial.glob("*.tmp"))

    monkeypatch.setattr(writer_mod, "save_file", real)  # space freed: the same command resumes
    resumed = run_quantize(args_for(tiny_v3, out))
    clean = run_quantize(args_for(tiny_v3, tmp_path / "clean"))
    assert resumed.manifest["resumed_from_layer"] == 1
    assert resumed.manifest["shards"] == clean.manifest["shards"]
    assert "dsquant" in json.loads((out / "config.json").read_text())  # item 7: serving insists on the manifest


def test_the_free_space_check_counts_the_resume_hidden_states(tiny_v3, tmp_path, monkeypatch):
    free = {"bytes": 1 << 30}
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(writer_mod.shutil, "disk_usage",
                        lambda p: type(usage)(usage.total, usage.used, free["bytes"]))
    w = ArtifactWriter(tmp_path / "out", 2, {}, force=False)
    shard = {"w": torch.zeros(1 << 18)}  # 1 MiB
    free["bytes"] = (1 << 20) + (3 << 20)
    w.write_shard(0, shard, reserve=1 << 20)  # shard + hidden + margin fit
    with pytest.raises(DsquantError, match=r"needs \d+ bytes .* free, the disk has") as e:
        w.write_shard(1, shard, reserve=1 << 30)  # the ~1 GB hidden states of a real model do not
    assert str(tmp_path / "out.partial") in str(e.value)
    with pytest.raises(DsquantError, match=HIDDEN):
        w.save_progress(1, torch.zeros(1 << 20), {})  # 4 MiB of hidden states

    reserved = []  # the pipeline reserves the hidden states' bytes with each shard
    real_write = ArtifactWriter.write_shard
    monkeypatch.setattr(ArtifactWriter, "write_shard",
                        lambda self, i, t, reserve=0: reserved.append(reserve) or real_write(self, i, t, reserve))
    free["bytes"] = 1 << 30
    run_quantize(args_for(tiny_v3, tmp_path / "run"))
    assert reserved[:3] == [4 * 64 * 128 * 4] * 3


def test_a_run_failing_before_any_progress_leaves_no_partial_dir(tiny_v3, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise DsquantError("simulated failure in layer 0")

    monkeypatch.setattr(pipeline, "quantize_layer", fail)
    with pytest.raises(DsquantError, match="simulated"):
        run_quantize(args_for(tiny_v3, tmp_path / "out"))
    assert not (tmp_path / "out.partial").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("layers, message", [(5, r"'model\.layers\.3\..*' is missing.*num_hidden_layers 5"),
                                             (2, r"in layer 2, but config.json says num_hidden_layers 2")])
def test_a_wrong_num_hidden_layers_fails_before_the_first_layer(tiny_v3, tmp_path, layers, message):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_v3, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (bad / "config.json").write_text(json.dumps(config))
    done = []
    with pytest.raises(CheckpointError, match=message):
        run_quantize(args_for(bad, tmp_path / "out"), lambda *a: done.append(a))
    assert done == [] and not (tmp_path / "out.partial").exists()
