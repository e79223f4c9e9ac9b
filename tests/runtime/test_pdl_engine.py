"""Programmatic dependent launch (runtime/kernels/pdl.py) changes when kernels start, never what they
compute: CUDA-graph decode with it on gives the same tokens and log-probabilities, bit for bit, as
with it off, for BF16, AWQ INT4 and FP8 block experts (the per-pair GEMVs, the K-block GEMVs, MLA
and the routing kernels all launched with it)."""
import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.kernels import pdl

from conftest import random_prompts
from test_quantized_checkpoints import write_pair


def _decode(path, prompts, config: EngineConfig | None = None, max_tokens: int = 12):
    """(token ids, logprobs) of greedy decode per prompt; by default CUDA-graph decode in bf16."""
    eng = LLMEngine(path, config or EngineConfig(device="cuda", dtype=torch.bfloat16, block_size=16, num_blocks=64,
                                                 max_model_len=128, cuda_graph_max_batch=8))
    assert config is not None or eng.runner.graphs is not None
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, ignore_eos=True))
           for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [(done[i].token_ids, done[i].logprobs) for i in ids]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "awq", "fp8"])
def test_pdl_decode_is_bitwise_unchanged(scheme, wide_moe, tmp_path, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    path = wide_moe if scheme == "bf16" else write_pair(wide_moe, tmp_path, scheme)[0]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for batch in (1, 3):
        prompts = random_prompts(batch, [9, 14, 3][:batch], seed=batch)
        monkeypatch.setattr(pdl, "ENABLED", False)
        off = _decode(path, prompts)
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert pdl.launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
        assert _decode(path, prompts) == off, (scheme, batch)
