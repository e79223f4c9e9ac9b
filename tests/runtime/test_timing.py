"""runtime/engine/timing.py's timed_generate, the loop validate's latency and the benchmarks time with:
every request gets one time per output token, in order and inside [start, end]; it finishes at its
last token; prompts keep their order and ids; the KV peak covers every prompt at once; and the
figures read off it (TTFT, gaps, tokens) count what was generated, with either stepping."""
import math

import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.engine.timing import timed_generate

from conftest import random_prompts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timed_generate_records_each_token_once_in_order(tiny_models, async_scheduling):
    _, path = tiny_models["llama"]
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=256,
                                          max_model_len=128, max_num_batched_tokens=64,
                                          async_scheduling=async_scheduling, enable_prefix_caching=False))
    prompts = random_prompts(3, [5, 9, 12], seed=4)
    run = timed_generate(engine, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                         request_ids=["a", "b", "c"])
    assert [r.request_id for r in run.requests] == ["a", "b", "c"]
    assert [r.prompt_tokens for r in run.requests] == [5, 9, 12] and run.input_tokens == 26
    for r in run.requests:
        assert r.output_tokens == 6
        assert run.start <= r.token_times[0] and r.token_times == sorted(r.token_times)
        assert r.finished_at == r.token_times[-1] <= run.end
    assert run.output_tokens == 18 and len(run.token_gaps()) == 3 * 5
    assert all(t > 0 for t in run.ttfts()) and all(g >= 0 for g in run.token_gaps())
    assert run.wall_s == run.end - run.start > 0
    assert run.peak_kv_blocks >= sum(math.ceil(n / 4) for n in (5, 9, 12))  # all three prefilled in one step
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_timed_generate_gives_ids_to_requests_without_them(tiny_models):
    _, path = tiny_models["qwen2"]
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=64,
                                          max_model_len=64))
    run = timed_generate(engine, random_prompts(2, [4, 4], seed=1), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len({r.request_id for r in run.requests}) == 2 and run.output_tokens == 6
    engine.close()
