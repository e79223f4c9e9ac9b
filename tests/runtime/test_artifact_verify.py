"""Serving refuses unchecked shards (issue 21, item 7): a dsquant artifact whose dsquant.json was
deleted is refused unless verification is off; other checkpoints get each shard's size checked
against its safetensors header."""
import json

import pytest
import torch
from safetensors.torch import save_file

from dsquant.errors import CheckpointError
from dsquant.models.checkpoint import check_shard_size
from dsquant.runtime.loader import verify_manifest


def artifact(path, made_by_dsquant: bool, sharded: bool = False):
    path.mkdir()
    config = {"model_type": "qwen2"}
    if made_by_dsquant:
        config["dsquant"] = {"version": "0.1.0", "manifest": "dsquant.json"}
    (path / "config.json").write_text(json.dumps(config))
    tensors = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    if sharded:
        save_file({"a": tensors["a"]}, str(path / "model-00001-of-00002.safetensors"))
        save_file({"b": tensors["b"]}, str(path / "model-00002-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
        return path / "model-00002-of-00002.safetensors"
    save_file(tensors, str(path / "model.safetensors"))
    return path / "model.safetensors"


def test_a_dsquant_artifact_without_its_manifest_is_refused(tmp_path):
    artifact(tmp_path / "art", made_by_dsquant=True)
    with pytest.raises(CheckpointError, match=r"dsquant\.json: missing.*dsquant made.*--no-verify"):
        verify_manifest(tmp_path / "art")


@pytest.mark.parametrize("sharded", [False, True])
def test_other_checkpoints_have_their_shard_sizes_checked(tmp_path, sharded):
    shard = artifact(tmp_path / "art", made_by_dsquant=False, sharded=sharded)
    assert verify_manifest(tmp_path / "art") == 0  # intact
    data = shard.read_bytes()
    for broken in (data[:-1], data + b"\0" * 16, data[:4], b"\xff" * 8 + data[8:]):
        shard.write_bytes(broken)
        with pytest.raises(CheckpointError, match=str(shard)):
            verify_manifest(tmp_path / "art")


def test_check_shard_size_names_the_byte_counts(tmp_path):
    shard = artifact(tmp_path / "art", made_by_dsquant=False)
    shard.write_bytes(shard.read_bytes()[:-10])
    size = shard.stat().st_size
    with pytest.raises(CheckpointError, match=rf"header says {size + 10} bytes but the file has {size}"):
        check_shard_size(shard)


def test_an_engine_refuses_the_artifact_and_no_verify_serves_it(tmp_path):
    """The bundled tiny model marked as dsquant-made, with no dsquant.json."""
    import shutil

    from dsquant.assets import bundled_model_path
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    art = tmp_path / "tiny"
    shutil.copytree(bundled_model_path("dsq-tiny-qwen2"), art)
    (art / "dsquant.json").unlink(missing_ok=True)
    config = json.loads((art / "config.json").read_text())
    (art / "config.json").write_text(json.dumps({**config, "dsquant": {"version": "0.1.0"}}))
    with pytest.raises(CheckpointError, match="--no-verify"):
        LLMEngine(art, EngineConfig(device="cpu", max_model_len=32, max_num_seqs=1))
    engine = LLMEngine(art, EngineConfig(device="cpu", max_model_len=32, max_num_seqs=1, verify_checksums=False))
    engine.close()
