"""Async scheduling (EngineConfig.async_scheduling) changes when tokens reach the host, never which:
every request's stream of outputs equals the synchronous engine's, stops drop the one token
computed past them, length limits waste none, and no KV block leaks. Each test also checks that
steps really were launched ahead of the previous step's read (else it would test the sync path)."""
import asyncio

import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

from conftest import eager_graphs_class, random_prompts


def engine(path, async_scheduling: bool, **kw) -> LLMEngine:
    base = dict(device="cpu", dtype=torch.float32, block_size=4, num_blocks=256, max_model_len=128,
                max_num_batched_tokens=64, async_scheduling=async_scheduling)
    return LLMEngine(path, EngineConfig(**{**base, **kw}))


def count_launches(eng: LLMEngine) -> dict:
    """Wrap eng.runner.launch: steps launched, of those launched before the previous step's tokens
    were read (batch.prev_tokens set), and rows sampled."""
    stats = {"launches": 0, "ahead": 0, "sampled": 0}
    launch = eng.runner.launch

    def counted(batch, steps=1):
        stats["launches"] += 1
        stats["ahead"] += batch.prev_tokens is not None
        out = launch(batch, steps)
        stats["sampled"] += 0 if out is None else out.device.shape[0]
        return out

    eng.runner.launch = counted
    return stats


def streams(eng: LLMEngine, prompts, params, on_step=None) -> list[list]:
    """Each request's RequestOutputs, in add order; checks every stream is well formed."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    got = {i: [] for i in ids}
    step = 0
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].append(out)
        step += 1
        if on_step is not None:
            on_step(step, ids)
    for outs in got.values():
        assert all(not o.finished for o in outs[:-1]), "an output after the finished one"
        assert [t for o in outs for t in o.new_token_ids] == (outs[-1].token_ids if outs else [])
        assert all(t >= 0 for o in outs for t in o.token_ids), "a placeholder reached an output"
    return [got[i] for i in ids]


def summary(stream_list) -> list[tuple]:
    """Per request: tokens, finish reason, text, and the stream's token / text pieces."""
    return [(s[-1].token_ids, s[-1].finish_reason, s[-1].text, [o.new_token_ids for o in s],
             [o.delta_text for o in s]) if s else None for s in stream_list]


def assert_no_leak(eng: LLMEngine):
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not eng.has_unfinished() and not eng.requests


def both(path, prompts, params, **kw):
    """(sync summary, async summary, async launch stats), each engine checked for leaks."""
    sync_eng, async_eng = engine(path, False, **kw), engine(path, True, **kw)
    stats = count_launches(async_eng)
    sync_out, async_out = streams(sync_eng, prompts, params), streams(async_eng, prompts, params)
    assert_no_leak(sync_eng)
    assert_no_leak(async_eng)
    return summary(sync_out), summary(async_out), stats


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_mixed_batch_with_chunked_prefill_equals_sync(family, tiny_models):
    """12 prompts of 1..40 tokens under a 64-token budget (chunked prefills beside decodes) and
    max_num_seqs 6 (requests queue and join while others decode)."""
    _, path = tiny_models[family]
    prompts = random_prompts(12, [1, 7, 40, 3, 16, 29, 4, 11], seed=2)
    sync_out, async_out, stats = both(path, prompts, GREEDY, max_num_seqs=6)
    assert async_out == sync_out
    assert stats["ahead"] > stats["launches"] // 2


def test_seeded_sampling_equals_sync(tiny_models):
    """Seeded random rows (temperature, top-k, top-p) draw from their own generators: identical."""
    _, path = tiny_models["qwen2"]
    prompts = random_prompts(6, [5, 17, 9], seed=3)
    params = [SamplingParams(max_tokens=8, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in [(0.9, 0, 1.0, 1), (1.3, 5, 1.0, 2), (0.7, 0, 0.8, 3), (0, 0, 1.0, None),
                                 (1.0, 20, 0.9, 5), (2.0, 0, 1.0, 6)]]
    sync_out, async_out, stats = both(path, prompts, params)
    assert async_out == sync_out
    assert stats["ahead"] > 0 and len({tuple(o[0]) for o in async_out}) == 6


def test_stop_token_eos_and_stop_string_drop_the_token_computed_past_them(llama_with_tokenizer):
    """One request stops on a stop token id, one on EOS, one on a stop string, one at max_tokens:
    outputs (tokens, text, deltas, reasons) equal the sync engine's; each stopped request had one
    more token sampled on the device, which never reached an output."""
    from tokenizers import Tokenizer

    _, path = llama_with_tokenizer
    prompts = random_prompts(4, [6, 11, 8, 3], seed=4, vocab=8192)
    free = [o[0] for o in summary(streams(engine(path, False), prompts, SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True)))]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = tok.decode(free[2], skip_special_tokens=True)
    words = text.split()
    assert len(words) > 2, text
    stop_string = words[len(words) // 2]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[0][3]]),
              SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_string]),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    sync_eng, async_eng = engine(path, False), engine(path, True)
    for eng in (sync_eng, async_eng):
        eng.eos_token_ids = {free[1][2]}
    stats = count_launches(async_eng)
    sync_out = summary(streams(sync_eng, prompts, params))
    async_out = summary(streams(async_eng, prompts, params))
    assert async_out == sync_out
    assert [o[1] for o in async_out] == ["stop", "stop", "stop", "length"]
    assert async_out[0][0] == free[0][:free[0].index(free[0][3]) + 1]
    assert async_out[1][0] == free[1][:free[1].index(free[1][2]) + 1]
    assert stop_string not in async_out[2][2] and len(async_out[2][0]) < 12
    returned = sum(len(o[0]) for o in async_out)
    assert stats["sampled"] == returned + 3  # one dropped token per stopped request
    for eng in (sync_eng, async_eng):
        assert_no_leak(eng)


def test_length_limits_end_without_a_wasted_step(tiny_models):
    """max_tokens and max_model_len are known at launch: such a sequence is never scheduled
    again, so every sampled row is returned."""
    _, path = tiny_models["llama"]
    prompts = random_prompts(3, [10, 4, 7], seed=7)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 1, 3)]
    sync_out, async_out, stats = both(path, prompts, params, max_model_len=12)
    assert async_out == sync_out
    assert [len(o[0]) for o in async_out] == [2, 1, 3]  # 10 + 2 tokens reach max_model_len 12
    assert stats["sampled"] == 6 and stats["ahead"] > 0


def test_abort_mid_stream(tiny_models):
    """A request aborted while its next token is in flight yields nothing more; the others equal
    the sync engine's; aborting everything leaves nothing in flight and no block held."""
    _, path = tiny_models["qwen2"]
    prompts = random_prompts(3, [9, 30, 5], seed=6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sync_out = summary(streams(engine(path, False), prompts, params))
    eng = engine(path, True)
    stats = count_launches(eng)
    aborted = {}

    def abort_second(step, ids):
        if step == 4:
            assert eng.pending is not None and eng.abort(ids[1])
            aborted["at"] = step

    got = streams(eng, prompts, params, on_step=abort_second)
    assert aborted and summary([got[0], got[2]]) == [sync_out[0], sync_out[2]]
    assert not got[1][-1].finished and len(got[1][-1].token_ids) < 12
    assert stats["ahead"] > 0
    assert_no_leak(eng)
    ids = [eng.add_request(p, params) for p in prompts]
    for _ in range(3):
        eng.step()
    assert eng.pending is not None
    assert all(eng.abort(i) for i in ids) and not eng.abort(ids[0])
    assert_no_leak(eng)


def test_preemption_under_a_tiny_kv_budget(tiny_models):
    """14 blocks of 4 tokens cannot hold 6 requests of up to 24 tokens at once: preemptions
    happen (the step before them is drained), and every request still equals the ample run."""
    _, path = tiny_models["qwen2"]
    prompts = random_prompts(6, [12, 19, 8], seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ample = summary(streams(engine(path, False, enable_prefix_caching=False), prompts, params))
    tight = engine(path, True, num_blocks=14, enable_prefix_caching=False)
    stats = count_launches(tight)
    assert summary(streams(tight, prompts, params)) == ample
    assert tight.scheduler.num_preemptions > 0 and stats["ahead"] > 0
    assert_no_leak(tight)


def test_prefix_cache_hits_and_tokens_equal_sync(tiny_models):
    """A second request sharing 18 prompt tokens hits 4 cached blocks in both modes; requests
    sharing a prefix run together give the same tokens too."""
    _, path = tiny_models["llama"]
    shared = random_prompts(1, [18], seed=3)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]
    results = {}
    for mode in (False, True):
        eng = engine(path, mode)
        stats = count_launches(eng)
        out = [summary(streams(eng, [first], GREEDY)), summary(streams(eng, [second], GREEDY))]
        hits = eng.block_manager.prefix_cache_hits
        out.append(summary(streams(eng, [shared + [1], second, first], GREEDY)))
        assert_no_leak(eng)
        results[mode] = (out, hits, stats["ahead"] > 0 or not mode)
    assert results[True] == results[False]
    assert results[True][1] == 16


def test_logprobs_requests_equal_sync(tiny_models):
    """A batch asking for logprobs / prompt_logprobs runs without overlap: the same tokens and
    log-probabilities, one logprobs entry per returned token."""
    _, path = tiny_models["llama"]
    prompts = random_prompts(3, [7, 12, 5], seed=8)
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    out = {}
    for mode in (False, True):
        got = streams(engine(path, mode), prompts, params)
        for o in got[0]:
            assert len(o.logprobs) == len(o.token_ids)
        out[mode] = [(summary([s]), s[-1].logprobs, s[-1].prompt_logprobs) for s in got]
    assert out[True] == out[False]


def test_llm_generate_with_async_scheduling():
    """dsquant.LLM on the bundled tiny Qwen2 (a real tokenizer): text prompts, a stop string."""
    import dsquant
    from dsquant.assets import bundled_models

    if "dsq-tiny-qwen2" not in bundled_models():
        pytest.skip("dsq-tiny-qwen2 is not bundled in this checkout")
    prompts = ["The quick brown fox", "def main():", "Once upon a time, there"]
    params = [SamplingParams(max_tokens=10, temperature=0), SamplingParams(max_tokens=7, temperature=0, stop=["\n"]),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3)]
    outs = {}
    for mode in (False, True):
        llm = dsquant.LLM("dsq-tiny-qwen2", device="cpu", dtype=torch.float32, num_blocks=64,
                          async_scheduling=mode)
        outs[mode] = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]
        assert_no_leak(llm.engine)
    assert outs[True] == outs[False] and all(o[0] for o in outs[True])


def test_server_engine_loop_streams_every_token(tiny_models):
    """The server's engine thread over an async engine delivers every output, in order, the last
    one finished, and leaves the engine idle."""
    pytest.importorskip("prometheus_client")
    from dsquant.runtime.server.engine_loop import EngineLoop
    from dsquant.runtime.server.metrics import ServerMetrics

    _, path = tiny_models["llama"]
    prompts = random_prompts(3, [9, 4, 13], seed=9)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 3, 8)]
    expected = summary(streams(engine(path, False), prompts, params))
    eng = engine(path, True)

    async def run():
        loop = EngineLoop(eng, ServerMetrics("tiny"))
        loop.start(asyncio.get_running_loop())
        handles = [loop.submit(p, sp, f"r{i}", 0.0) for i, (p, sp) in enumerate(zip(prompts, params))]

        async def collect(h):
            got = [o async for o in h.outputs()]
            h.close()
            return got

        try:
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            loop.stop()

    got = asyncio.run(run())
    assert summary(got) == expected
    assert_no_leak(eng)


def test_graph_path_fills_placeholders_in_the_static_buffers(tiny_models):
    """The decode-graph path on CPU, through a stand-in whose replay runs the model eagerly on the
    graphs' static buffers: placeholder input ids are filled there from the previous step's
    tokens (in order and out of order) and every output equals the sync engine's."""
    EagerGraphs = eager_graphs_class()
    _, path = tiny_models["llama"]
    prompts = random_prompts(7, [9, 14, 3, 30, 1], seed=1)
    params = [SamplingParams(max_tokens=3 + 2 * (i % 4), temperature=0 if i % 3 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    out = {}
    for mode in (False, True):
        eng = engine(path, mode, max_num_seqs=4, max_num_batched_tokens=32)
        eng.runner.graphs = EagerGraphs(eng.runner, 4)
        stats = count_launches(eng)
        out[mode] = summary(streams(eng, prompts, params))
        assert_no_leak(eng)
        assert stats["ahead"] > 5 or not mode
    assert out[True] == out[False] and EagerGraphs.replays > 10


def cuda_engine(path, async_scheduling: bool, dtype, **kw) -> tuple[LLMEngine, dict, dict]:
    """A CUDA engine with decode graphs of up to 8 rows; (engine, launch stats, graph replay count)."""
    eng = engine(path, async_scheduling, device="cuda", dtype=dtype, enforce_eager=False, max_num_seqs=8,
                 cuda_graph_max_batch=8, **kw)
    assert eng.runner.graphs is not None
    replays, replay = {"n": 0}, eng.runner.graphs.replay

    def counted(n):
        replays["n"] += 1
        return replay(n)

    eng.runner.graphs.replay = counted
    return eng, count_launches(eng), replays


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graphs_async_equals_sync(dtype, tiny_models):
    """8 requests admitted together, greedy and seeded rows, different max_tokens: the decode
    graphs read their input ids from the previous step's tokens on the device (in order), and
    every output equals async off. The batches are the same in both modes, so bf16 compares too."""
    _, path = tiny_models["deepseek_v2"]
    prompts = random_prompts(8, [9, 14, 3, 30, 1], seed=1)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0 if i % 3 else 0.9, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    out = {}
    for mode in (False, True):
        eng, stats, replays = cuda_engine(path, mode, dtype, max_num_batched_tokens=256)
        out[mode] = summary(streams(eng, prompts, params))
        assert_no_leak(eng)
        assert replays["n"] > 5 and (stats["ahead"] > 5 or not mode)
    assert out[True] == out[False]


@pytest.mark.gpu
def test_cuda_graphs_async_with_queueing_and_stops_equals_sync(tiny_models):
    """fp32 (batches differ between the modes here: a stopped request's dropped row, later
    admissions): 11 requests through 8 slots, a stop token, chunked prefills beside graph decodes,
    so placeholder rows are filled out of order too."""
    _, path = tiny_models["deepseek_v2"]
    prompts = random_prompts(11, [9, 14, 3, 30, 1], seed=1)
    params = [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0 if i % 3 else 0.9, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    params[0] = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    probe, _, _ = cuda_engine(path, False, torch.float32, max_num_batched_tokens=32)  # the same batches
    free = summary(streams(probe, prompts, params))[0][0]  # request 0's greedy tokens without a stop
    params[0] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[free[2]], ignore_eos=True)
    out = {}
    for mode in (False, True):
        eng, stats, replays = cuda_engine(path, mode, torch.float32, max_num_batched_tokens=32)
        out[mode] = summary(streams(eng, prompts, params))
        assert_no_leak(eng)
        assert replays["n"] > 5 and (stats["ahead"] > 5 or not mode)
    assert out[True] == out[False]
    assert out[True][0][1] == "stop"
