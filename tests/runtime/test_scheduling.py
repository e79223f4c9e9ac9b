"""Batching, chunked prefill, prefix caching, preemption and aborts never change greedy tokens,
and never leak a KV block."""
import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

from conftest import random_prompts

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def engine(path, **kw) -> LLMEngine:
    base = dict(device="cpu", dtype=torch.float32, block_size=4, num_blocks=256, max_model_len=128,
                max_num_batched_tokens=64)
    return LLMEngine(path, EngineConfig(**{**base, **kw}))


def run_all(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def assert_no_leak(eng: LLMEngine):
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_alone_equals_inside_mixed_batch(family, tiny_models):
    """32 prompts of lengths 1..40 under a 64-token budget (so prompts are chunked) and
    max_num_seqs 12 (so requests queue): each one's tokens equal its solo run."""
    _, path = tiny_models[family]
    prompts = random_prompts(32, [1, 7, 40, 3, 16, 29, 4, 11], seed=2)
    eng = engine(path, max_num_seqs=12)
    batched = run_all(eng, prompts)
    assert_no_leak(eng)
    solo_eng = engine(path, enable_prefix_caching=False)
    for i in (0, 2, 5, 13):  # a sample of solo runs keeps the test fast
        assert run_all(solo_eng, [prompts[i]]) == [batched[i]], f"prompt {i}"


def test_prefix_cache_hit_gives_identical_tokens(tiny_models):
    _, path = tiny_models["deepseek_v3"]
    shared = random_prompts(1, [18], seed=3)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]
    eng = engine(path)
    run_all(eng, [first])
    hits_before = eng.block_manager.prefix_cache_hits
    out = run_all(eng, [second])
    hits = eng.block_manager.prefix_cache_hits - hits_before
    assert hits == 16  # 4 full blocks of the 18 shared tokens
    assert eng.block_manager.prefix_cache_queries == len(first) + len(second)
    assert out == run_all(engine(path, enable_prefix_caching=False), [second])
    assert_no_leak(eng)


def test_prompt_fully_cached_still_computes_its_last_token(tiny_models):
    _, path = tiny_models["llama"]
    prompt = random_prompts(1, [16], seed=4)[0]  # exactly 4 blocks
    eng = engine(path)
    a = run_all(eng, [prompt])
    b = run_all(eng, [prompt])
    assert a == b
    assert eng.block_manager.prefix_cache_hits == 12  # the block holding the last token is recomputed


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "deepseek_v2"])
def test_preemption_completes_every_request_identically(family, async_scheduling, tiny_models):
    """14 blocks of 4 tokens cannot hold 6 requests of up to 24 tokens at once."""
    _, path = tiny_models[family]
    prompts = random_prompts(6, [12, 19, 8], seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ample = run_all(engine(path, enable_prefix_caching=False), prompts, params)
    tight = engine(path, num_blocks=14, enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert run_all(tight, prompts, params) == ample
    assert tight.scheduler.num_preemptions > 0
    assert_no_leak(tight)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks(async_scheduling, tiny_models):
    _, path = tiny_models["llama"]
    eng = engine(path, async_scheduling=async_scheduling)
    ids = [eng.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
           for p in random_prompts(3, [9, 30], seed=6)]
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    for i in ids:
        assert eng.abort(i)
    assert not eng.abort(ids[0])
    assert_no_leak(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_and_max_model_len(async_scheduling, tiny_models):
    _, path = tiny_models["llama"]
    prompt = random_prompts(1, [10], seed=7)[0]
    eng = engine(path, async_scheduling=async_scheduling)
    free_run = run_all(eng, [prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    stop_at = free_run[2]
    eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[stop_at]))
    outs = [o for _ in range(10) for o in eng.step()]
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == free_run[:free_run.index(stop_at) + 1]
    short = engine(path, max_model_len=12, async_scheduling=async_scheduling)
    eng_out = run_all(short, [prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert eng_out == free_run[:2]  # 10 prompt tokens + 2 generated reach max_model_len


def _step(sched, batch):
    """Mark a scheduled batch computed, as the engine does after a step (a sampled token appended)."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)


@pytest.mark.parametrize("threshold", [0, 16])
def test_long_prefill_token_threshold_caps_chunks_only_beside_others(threshold):
    """A 300-token prompt under a 64-token budget: alone it takes the whole budget; once two short
    prompts arrive its chunk is capped at the threshold, which lets them in and, once they decode,
    keeps the steps beside them short. With no threshold the long prompt holds the whole budget and
    the short ones wait for its prefill to end."""
    from dsquant.runtime.engine.block_manager import BlockManager
    from dsquant.runtime.engine.scheduler import Scheduler, SchedulerConfig
    from dsquant.runtime.engine.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      long_prefill_token_threshold=threshold), BlockManager(256, 4))
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    sched.add(Sequence(0, "long", list(range(300)), params))
    first = sched.schedule()
    assert first.num_new_tokens == [64]  # alone: the whole budget
    _step(sched, first)
    for i in (1, 2):
        sched.add(Sequence(i, f"s{i}", [7, 8, 9], params))
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append(list(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)))
        _step(sched, batch)
    if threshold:
        assert steps == [[("long", 16), ("s1", 3), ("s2", 3)],
                         [("s1", 1), ("s2", 1), ("long", 16)], [("s1", 1), ("s2", 1), ("long", 16)]]
    else:
        assert steps == [[("long", 64)], [("long", 64)], [("long", 64)]]


def test_long_prefill_token_threshold_keeps_greedy_tokens(tiny_models):
    """Chunks capped at 8 tokens beside other requests give each prompt its solo tokens, no leak."""
    _, path = tiny_models["deepseek_v2"]
    prompts = random_prompts(6, [40, 3, 29, 7], seed=5)
    eng = engine(path, long_prefill_token_threshold=8)
    batched = run_all(eng, prompts)
    assert_no_leak(eng)
    solo = engine(path, enable_prefix_caching=False)
    for i in (0, 2):
        assert run_all(solo, [prompts[i]]) == [batched[i]], f"prompt {i}"
