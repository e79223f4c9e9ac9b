"""The engine's per-step time split (runtime/engine/step_times.py) and validate's interleaved latency
rounds (validate/latency.py merge_rounds): each launched step is recorded once with its sampled rows,
its wall time covers its wait for tokens, the split's host time is wall minus that wait, and recording
changes no token. On CPU there is no GPU time (NaN). A StepTimes given to measure_latency records
every step, warm-up included, and the decode split still counts only the timed decode runs' steps."""
import math

import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.engine.step_times import StepTimes
from dsquant.validate.latency import LatencyResult, merge_rounds

from conftest import random_prompts


def _engine(path, async_scheduling):
    return LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=256,
                                        max_model_len=128, max_num_batched_tokens=64, enable_prefix_caching=False,
                                        async_scheduling=async_scheduling))


def _generate(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = list(o.token_ids)
    return [outs[i] for i in ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_times_record_each_launched_step(tiny_models, async_scheduling):
    _, path = tiny_models["llama"]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(2, [5, 9], seed=3)
    plain = _engine(path, async_scheduling)
    want = _generate(plain, prompts, params)
    plain.close()
    engine = _engine(path, async_scheduling)
    times = StepTimes()
    engine.time_steps(times)
    got = _generate(engine, prompts, params)
    # both prompts prefill in one step, then 6 decode steps of 2 rows: 7 launched steps, each sampling 2
    assert [r.rows for r in times.records] == [2] * 7
    assert all(r.wall_s >= r.wait_s >= 0 and r.cpu_s > 0 and r.gpu is None for r in times.records)
    split = times.split(2)
    assert split["steps"] == 7 and 0 < split["host_us"] <= split["wall_us"] and math.isnan(split["gpu_us"])
    assert times.split(2, since=3)["steps"] == 4 and times.split(2, since=7) is None
    assert times.split(1) is None
    engine.time_steps(None)
    assert engine.step_times is None and engine.runner.step_times is None
    assert got == want and all(len(t) == 7 for t in got)
    engine.close()


def test_merge_rounds_takes_the_median_over_every_repeat():
    a = LatencyResult("cuda", {}, 0.010, 0.0004, {64: 40000.0}, [0.010, 0.012], [0.0004, 0.0005],
                      {64: [40000.0, 42000.0]}, {1: {"steps": 10, "wall_us": 400.0, "host_us": 380.0, "gpu_us": 150.0}})
    b = LatencyResult("cuda", {}, 0.020, 0.0008, {64: 20000.0}, [0.020, 0.011], [0.0008, 0.00045],
                      {64: [20000.0, 41000.0]}, {1: {"steps": 10, "wall_us": 800.0, "host_us": 760.0, "gpu_us": 160.0}})
    m = merge_rounds([a, b])
    assert m.ttft_runs == [0.010, 0.012, 0.020, 0.011] and m.ttft_s == pytest.approx(0.0115)
    assert m.tpot_s == pytest.approx(0.000475) and m.throughput_tok_s[64] == pytest.approx(40500.0)
    assert m.throughput_runs[64] == [40000.0, 42000.0, 20000.0, 41000.0]
    assert m.decode_split[1]["host_us"] == pytest.approx(570.0) and m.decode_split[1]["gpu_us"] == pytest.approx(155.0)
    assert merge_rounds([a]).tpot_s == pytest.approx(0.00045)


def test_measure_latency_splits_the_decode_steps(tiny_models):
    from dsquant.validate.latency import LatencySpec, measure_latency

    _, path = tiny_models["qwen2"]
    spec = LatencySpec(ttft_input=8, tpot_output=6, throughput_input=8, throughput_output=5, batch_sizes=(4,),
                       repeats=2, split_steps=True)
    r = measure_latency(str(path), "cpu", spec, dtype=torch.float32)
    assert set(r.decode_split) == {1, 4}
    for b, s in r.decode_split.items():
        assert s["steps"] >= 5 and 0 < s["host_us"] <= s["wall_us"] and math.isnan(s["gpu_us"])
    assert not measure_latency(str(path), "cpu", LatencySpec(8, 6, 8, 5, (4,), 1), dtype=torch.float32).decode_split


def test_measure_latency_records_every_step_into_a_given_step_times(tiny_models):
    from dsquant.validate.latency import LatencySpec, measure_latency

    _, path = tiny_models["qwen2"]
    spec = LatencySpec(ttft_input=8, tpot_output=6, throughput_input=8, throughput_output=5, batch_sizes=(4,),
                       repeats=2, split_steps=True)
    times = StepTimes()
    r = measure_latency(str(path), "cpu", spec, dtype=torch.float32, step_times=times)
    # each TPOT run samples one row 6 times and each throughput run four rows 5 times: the split counts
    # those steps only, though `times` also holds the warm-up's and the TTFT runs'
    assert r.decode_split[1]["steps"] == 6 and r.decode_split[4]["steps"] == 5
    warm, timed = 1 + 6 + 5, 2 * (1 + 6) + 2 * 5
    assert len(times.records) >= warm + timed and sum(x.rows == 4 for x in times.records) == 5 + 2 * 5
