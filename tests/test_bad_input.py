"""Bad checkpoints give one-line errors naming the file or tensor, exit code 2, no traceback.

Each case breaks a valid sharded checkpoint in one way and runs `dsquant inspect` on it through
the real entry point (a subprocess), and `load_model` in-process.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dsquant.errors import DsquantError
from dsquant.models import load_model


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A tiny V3 checkpoint in 3 shards with an index."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("good")
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "dsquant", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def broken_copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def shard_names(path):
    return sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))


def rewrite_tensor(path, key, fn):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index[key]
    tensors = load_file(shard)
    tensors[key] = fn(tensors[key])
    save_file(tensors, shard, metadata={"format": "pt"})


def break_missing_dir(path):
    shutil.rmtree(path)
    return "no such directory"


def break_architecture(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    return "'MixtralForCausalLM' is not supported"


def break_missing_shard(path):
    name = shard_names(path)[1]
    (path / name).unlink()
    return f"{name}: shard listed in model.safetensors.index.json is missing"


def break_truncated_shard(path):
    name = shard_names(path)[0]
    size = (path / name).stat().st_size
    with open(path / name, "r+b") as f:
        f.truncate(size // 2)
    return f"{name}: truncated or corrupt safetensors file"


def break_shape(path):
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    rewrite_tensor(path, key, lambda t: t[:, :-1].contiguous())
    return f"'{key}' has shape (32, 15), expected (32, 16)"


def break_dtype(path):
    key = "model.layers.0.mlp.down_proj.weight"
    rewrite_tensor(path, key, lambda t: (t * 100).to(torch.int32))
    return f"'{key}' has dtype"


def break_missing_tensor(path):
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_tensor(path, key, lambda t: t)  # keep the file valid, then drop the key
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = path / index["weight_map"].pop(key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return f"'{key}' is missing"


BREAKERS = [break_missing_dir, break_architecture, break_missing_shard, break_truncated_shard,
            break_shape, break_dtype, break_missing_tensor]


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda f: f.__name__[len("break_"):])
def test_cli_reports_one_line_and_exit_2(breaker, good_checkpoint, tmp_path):
    path = broken_copy(good_checkpoint, tmp_path)
    expected = breaker(path)
    result = run_cli("inspect", str(path))
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda f: f.__name__[len("break_"):])
def test_load_model_raises_named_error(breaker, good_checkpoint, tmp_path):
    path = broken_copy(good_checkpoint, tmp_path)
    expected = breaker(path)
    with pytest.raises(DsquantError) as err:
        load_model(path, dtype=torch.float32)
    assert expected in str(err.value)


def test_debug_flag_shows_traceback(tmp_path):
    result = run_cli("--debug", "inspect", str(tmp_path / "nope"))
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_good_checkpoint_inspects(good_checkpoint):
    result = run_cli("inspect", str(good_checkpoint))
    assert result.returncode == 0, result.stderr
    assert "DeepseekV3ForCausalLM" in result.stdout
    assert "1 dense, 1 MoE" in result.stdout
    assert "mlp.experts.*.down_proj" in result.stdout


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
        "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    result = run_cli("inspect", str(tmp_path))
    assert result.returncode == 2
    assert "never unpickles" in result.stderr
