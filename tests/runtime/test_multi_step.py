"""Multi-step decoding (EngineConfig.num_scheduler_steps, multi_step.py) changes how many tokens one
launch returns, never which: every request's tokens, finish reason and text equal the single-step
engine's, stops inside a burst drop the tokens after them, length limits shorten the burst, requests
that need the host between steps run single steps, and no KV block leaks. Each test also checks
that bursts really ran (else it would test the single-step path)."""
import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

from conftest import eager_graphs_class, random_prompts
from test_async_scheduling import assert_no_leak, streams


def engine(path, steps: int, async_scheduling: bool = True, **kw) -> LLMEngine:
    base = dict(device="cpu", dtype=torch.float32, block_size=4, num_blocks=256, max_model_len=128,
                max_num_batched_tokens=64, async_scheduling=async_scheduling, num_scheduler_steps=steps)
    return LLMEngine(path, EngineConfig(**{**base, **kw}))


def count_bursts(eng: LLMEngine) -> dict:
    """Wrap eng.runner.launch: launches, those that ran a burst, and rows sampled in all."""
    stats = {"launches": 0, "bursts": 0, "sampled": 0, "longest": 1}
    launch = eng.runner.launch

    def counted(batch, steps=1):
        stats["launches"] += 1
        stats["bursts"] += steps > 1
        stats["longest"] = max(stats["longest"], steps)
        out = launch(batch, steps)
        stats["sampled"] += 0 if out is None else out.device.shape[0]
        return out

    eng.runner.launch = counted
    return stats


def final(stream_list) -> list[tuple]:
    """Per request: tokens, finish reason, text, and the deltas joined (the pieces differ by design)."""
    return [(s[-1].token_ids, s[-1].finish_reason, s[-1].text, "".join(o.delta_text for o in s))
            for s in stream_list]


def compare(path, prompts, params, steps=4, **kw):
    """(single-step summary, burst summary, burst stats); both engines checked for leaks."""
    one, many = engine(path, 1, **kw), engine(path, steps, **kw)
    stats = count_bursts(many)
    a, b = final(streams(one, prompts, params)), final(streams(many, prompts, params))
    assert_no_leak(one)
    assert_no_leak(many)
    return a, b, stats


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_greedy_batch_with_queued_requests_equals_single_steps(family, async_scheduling, tiny_models):
    """10 prompts, max_num_seqs 4: requests queue behind full batches (bursts run while nothing can be
    admitted), finish at different lengths and free their slots."""
    _, path = tiny_models[family]
    prompts = random_prompts(10, [1, 7, 30, 3, 16, 9], seed=2)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 3, 14, 6, 11, 2, 8, 5, 13, 7)]
    one, many, stats = compare(path, prompts, params, max_num_seqs=4, async_scheduling=async_scheduling)
    assert many == one
    assert stats["bursts"] > 0 and stats["longest"] == 4
    assert stats["sampled"] == sum(len(o[0]) for o in many)  # length limits: nothing sampled in vain


def test_bursts_sample_exactly_what_is_returned_at_length_limits(tiny_models):
    """max_tokens and max_model_len bound every burst: no token is sampled past them."""
    _, path = tiny_models["llama"]
    prompts = random_prompts(3, [10, 4, 7], seed=7)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 1, 6)]
    one, many, stats = compare(path, prompts, params, steps=8, max_model_len=17)
    assert many == one
    assert [len(o[0]) for o in many] == [7, 1, 6]  # 10 + 7 tokens reach max_model_len 17
    assert stats["sampled"] == 14 and stats["bursts"] > 0


def test_seeded_sampling_equals_single_steps(tiny_models):
    _, path = tiny_models["qwen2"]
    prompts = random_prompts(5, [5, 17, 9], seed=3)
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in [(0.9, 0, 1.0, 1), (1.3, 5, 1.0, 2), (0.7, 0, 0.8, 3), (0, 0, 1.0, None),
                                 (1.0, 20, 0.9, 5)]]
    one, many, stats = compare(path, prompts, params, steps=3)
    assert many == one
    assert stats["bursts"] > 0 and len({tuple(o[0]) for o in many}) == 5


def test_stops_inside_a_burst_drop_the_tokens_after_them(llama_with_tokenizer):
    """A stop token id, EOS and a stop string, each met inside a burst, and max_tokens: outputs equal
    the single-step engine's; the tokens a burst computed past a stop never reach an output."""
    from tokenizers import Tokenizer

    _, path = llama_with_tokenizer
    prompts = random_prompts(4, [6, 11, 8, 3], seed=4, vocab=8192)
    free = [o[0] for o in final(streams(engine(path, 1), prompts, SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True)))]
    text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(free[2], skip_special_tokens=True)
    words = text.split()
    assert len(words) > 2, text
    stop_string = words[len(words) // 2]
    params = [SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[free[0][5]]),
              SamplingParams(max_tokens=16, temperature=0),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_string]),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]
    engines = [engine(path, 1), engine(path, 8)]
    for eng in engines:
        eng.eos_token_ids = {free[1][6]}
    stats = count_bursts(engines[1])
    one, many = (final(streams(eng, prompts, params)) for eng in engines)
    assert many == one
    assert [o[1] for o in many] == ["stop", "stop", "stop", "length"]
    assert many[0][0] == free[0][:free[0].index(free[0][5]) + 1]
    assert many[1][0] == free[1][:free[1].index(free[1][6]) + 1]
    assert stop_string not in many[2][2] and len(many[2][0]) < 16
    assert stats["bursts"] > 0 and stats["sampled"] > sum(len(o[0]) for o in many)
    for eng in engines:
        assert_no_leak(eng)


def test_requests_that_need_the_host_between_steps_run_single_steps(tiny_models):
    """logprobs and penalties read the tokens so far on the host: no burst while such a request runs,
    and the results equal the single-step engine's."""
    _, path = tiny_models["llama"]
    prompts = random_prompts(2, [7, 12], seed=8)
    for special in (dict(logprobs=2), dict(frequency_penalty=0.5), dict(logit_bias={3: 2.0})):
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **special),
                  SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
        one, many, stats = compare(path, prompts, params)
        assert many == one and stats["bursts"] == 0, special


def test_lookahead_blocks_missing_means_single_steps(tiny_models):
    """With the KV cache too small for a burst's lookahead blocks, steps run one at a time (no
    preemption for lookahead); the tokens equal the ample run's."""
    _, path = tiny_models["qwen2"]
    prompts = random_prompts(3, [12, 15, 10], seed=5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ample = final(streams(engine(path, 1, enable_prefix_caching=False), prompts, params))
    tight = engine(path, 8, num_blocks=16, enable_prefix_caching=False)
    stats = count_bursts(tight)
    assert final(streams(tight, prompts, params)) == ample
    assert stats["longest"] < 8
    assert_no_leak(tight)


def test_prefix_cache_after_bursts(tiny_models):
    """Blocks filled during bursts are registered for the prefix cache: a later request sharing the
    generated text hits them, with the same tokens as the single-step engine."""
    _, path = tiny_models["llama"]
    prompt = random_prompts(1, [9], seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = {}
    for steps in (1, 4):
        eng = engine(path, steps)
        first = final(streams(eng, [prompt], params))
        again = final(streams(eng, [prompt + first[0][0]], params))
        got[steps] = (first, again, eng.block_manager.prefix_cache_hits)
        assert_no_leak(eng)
    assert got[4] == got[1] and got[4][2] >= 16


def test_num_scheduler_steps_must_be_positive(tiny_models):
    _, path = tiny_models["llama"]
    with pytest.raises(DsquantError, match="num_scheduler_steps"):
        engine(path, 0)


def test_graph_path_bursts_equal_single_steps(tiny_models):
    """The decode-graph path of a burst on CPU: DecodeGraphs' static buffers, staged by prepare and
    advanced by advance_static_inputs (what the burst graphs capture), with each replay run eagerly.
    Greedy and seeded rows, requests joining and leaving (bucket padding rows stay inert)."""
    EagerGraphs = eager_graphs_class()
    _, path = tiny_models["llama"]
    prompts = random_prompts(7, [9, 14, 3, 30, 1], seed=1)
    params = [SamplingParams(max_tokens=3 + 4 * (i % 4), temperature=0 if i % 3 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    out = {}
    for steps in (1, 4):
        eng = engine(path, steps, max_num_seqs=3, max_num_batched_tokens=32)
        eng.runner.graphs = EagerGraphs(eng.runner, 3)  # buckets 1, 2, 4: three rows pad to four
        stats = count_bursts(eng)
        out[steps] = final(streams(eng, prompts, params))
        assert_no_leak(eng)
        assert stats["bursts"] > 2 or steps == 1
    assert out[4] == out[1] and EagerGraphs.bursts > 5


def cuda_engine(path, steps: int, dtype, **kw) -> tuple[LLMEngine, dict]:
    eng = engine(path, steps, device="cuda", dtype=dtype, enforce_eager=False, max_num_seqs=8,
                 cuda_graph_max_batch=8, **kw)
    assert eng.runner.graphs is not None and (steps == 1 or eng.runner.graphs.burst_graphs)
    return eng, count_bursts(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_bursts_equal_single_steps(dtype, tiny_models):
    """The captured burst graphs (inputs advanced on the device, input ids from the previous step's
    tokens), greedy and seeded rows. bf16: 8 requests that all fit, so every decode position runs the
    same rows in both modes; fp32: 11 requests through 8 slots and a stop token inside a burst (the
    modes batch differently there)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _, path = tiny_models["deepseek_v2"]
    count = 8 if dtype == torch.bfloat16 else 11
    prompts = random_prompts(count, [9, 14, 3, 30, 1], seed=1)
    params = [SamplingParams(max_tokens=6 + 5 * (i % 5), temperature=0 if i % 3 else 0.9, seed=i,
                             ignore_eos=True) for i in range(count)]
    if dtype == torch.float32:
        probe, _ = cuda_engine(path, 1, dtype, max_num_batched_tokens=256)
        free = final(streams(probe, prompts, params))[1][0]
        params[1] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[free[6]], ignore_eos=True)
    out = {}
    for steps in (1, 4):
        eng, stats = cuda_engine(path, steps, dtype, max_num_batched_tokens=256)
        out[steps] = final(streams(eng, prompts, params))
        assert_no_leak(eng)
        assert stats["bursts"] > 3 or steps == 1
    assert out[4] == out[1]
    assert dtype == torch.bfloat16 or out[4][1][1] == "stop"


def test_step_times_and_latency_count_per_decode_step(tiny_models):
    """A burst is one StepRecord with its steps; split() gives times per decode step. validate's
    latency engine takes num_scheduler_steps from its LatencySpec and measures TPOT over the burst's
    tokens (they arrive together, so per-token gaps would be zero inside a burst)."""
    from dataclasses import replace

    from dsquant.runtime.engine.step_times import StepTimes
    from dsquant.validate.latency import LatencySpec, measure_latency

    _, path = tiny_models["llama"]
    eng = engine(path, 4, enable_prefix_caching=False)
    times = StepTimes()
    eng.time_steps(times)
    final(streams(eng, random_prompts(2, [5, 9], seed=3), SamplingParams(max_tokens=9, temperature=0,
                                                                          ignore_eos=True)))
    # one prefill step sampling 2 rows, then bursts of 4 and 4 (8 more tokens each)
    assert [(r.rows, r.steps) for r in times.records] == [(2, 1), (2, 4), (2, 4)]
    split = times.split(2, since=1)
    whole = [r.wall_s for r in times.records[1:]]
    assert split["steps"] == 2 and split["wall_us"] == pytest.approx(sum(whole) / 2 / 4 * 1e6)
    spec = replace(LatencySpec.for_device("cpu"), batch_sizes=(4,), repeats=1, tpot_output=9, throughput_output=9,
                   num_scheduler_steps=4, split_steps=True)
    result = measure_latency(str(path), "cpu", spec, dtype=torch.float32, max_num_seqs=4)
    assert result.spec["num_scheduler_steps"] == 4 and 0 < result.tpot_s < 1
    # the TPOT run's steps: its prefill, then bursts of 4 and 4
    assert result.throughput_tok_s[4] > 0 and result.decode_split[1]["steps"] == 3
