"""A step's inputs reach the device in one packed copy and hold the values the sequences imply;
CUDA-graph decode steps get the same tokens as eager ones."""
import pytest
import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.packed_copy import PackedCopy
from dsquant.runtime.engine.sequence import SamplingParams

from conftest import random_prompts

I64, I32, F32 = torch.int64, torch.int32, torch.float32


def _fields(seed: int) -> list[tuple[list, torch.dtype]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, dtype in [(3, I64), (5, I32), (0, I32), (7, F32), (1, I64), (2 * seed + 1, I32), (4, F32)]:
        values = torch.randn(n, generator=g) * 100
        out.append((values.tolist() if dtype == F32 else values.long().tolist(), dtype))
    return out


def _check_pack(packer: PackedCopy, seed: int, device) -> None:
    fields = _fields(seed)
    got = packer.pack(fields)
    assert [t.dtype for t in got] == [d for _, d in fields]
    for t, (values, dtype) in zip(got, fields):
        assert t.device.type == torch.device(device).type
        assert torch.equal(t.cpu(), torch.tensor(values, dtype=dtype)), (values, t)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_fields_equal_their_values_across_steps_and_growth(dev):
    packer = PackedCopy(torch.device(dev))
    for seed in (0, 3, 900):  # the last one outgrows the first buffer
        _check_pack(packer, seed, dev)


@pytest.mark.gpu
def test_pinned_buffer_reuse_without_sync_keeps_each_steps_values():
    """Step 2 rewrites the pinned host buffer while step 1's copy may be queued: the event wait
    in pack must keep step 1's device values intact for the work queued after it."""
    packer = PackedCopy(torch.device("cuda"))
    torch.cuda._sleep(50_000_000)  # hold the stream so the copies queue behind it
    first = [t.clone() for t in packer.pack([(list(range(1000)), I64)])]
    second = [t.clone() for t in packer.pack([(list(range(5, 1005)), I64)])]
    assert first[0].tolist() == list(range(1000)) and second[0].tolist() == list(range(5, 1005))


def test_prepare_builds_what_the_sequences_say(tiny_models):
    """Mixed steps (prefill chunks, decodes, prompt logprobs, greedy and random rows): every field
    of StepInputs equals the value computed from the sequences."""
    _, path = tiny_models["deepseek_v2"]
    eng = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=4, num_blocks=128,
                                       max_model_len=96, max_num_batched_tokens=24))
    runner, bs, seen = eng.runner, 4, []
    prepare = runner.prepare

    def checked(batch):
        inputs = prepare(batch)
        ids, pos, slots, seq_lens, rows, span_rows, sampled = [], [], [], [], [], [], []
        for seq, n, samp in zip(batch.seqs, batch.num_new_tokens, batch.samples()):
            start = seq.num_computed_tokens
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if seq.prompt_logprobs is not None and count > 0:
                span_rows += range(len(ids), len(ids) + count)
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            seq_lens.append(start + n)
            if samp:
                rows.append(len(ids) - 1)
                sampled.append(seq)
        ctx = inputs.ctx
        assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == pos
        assert ctx.slot_mapping.tolist() == slots and ctx.seq_lens.tolist() == seq_lens
        assert inputs.logits_indices.tolist() == rows + span_rows
        assert ctx.cu_seqlens_q.tolist() == [sum(batch.num_new_tokens[:i]) for i in range(len(batch.seqs) + 1)]
        for row, seq in zip(ctx.block_tables.tolist(), batch.seqs):
            assert row[:len(seq.block_table)] == seq.block_table
        assert (ctx.slot_mapping.dtype, ctx.seq_lens.dtype, ctx.block_tables.dtype) == (I64, I32, I32)
        t = inputs.sampling
        if all(s.params.greedy for s in sampled):
            assert t.temperature is None and not t.any_random
        else:
            assert t.temperature.tolist() == pytest.approx([s.params.temperature for s in sampled])
            assert t.top_k.tolist() == [s.params.top_k or 256 for s in sampled]
        seen.append((len(batch.seqs), t.any_random))
        return inputs

    runner.prepare = checked
    prompts = random_prompts(4, [30, 5, 11, 17], seed=4)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, top_k=5, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=1.3, ignore_eos=True)]
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
    assert any(r for _, r in seen) and any(not r for _, r in seen) and max(n for n, _ in seen) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("greedy_in_graph", [False, True])
def test_graph_decode_equals_eager_with_mixed_sampling(tiny_models, greedy_in_graph, monkeypatch):
    """Three decodes (padded to the bucket of 4), greedy and seeded random rows, through the CUDA
    graphs (with and without the argmax captured in them) and eagerly: the same tokens."""
    from dsquant.runtime.engine import cuda_graph

    monkeypatch.setattr(cuda_graph, "GREEDY_IN_GRAPH", greedy_in_graph)
    _, path = tiny_models["deepseek_v2"]
    prompts = random_prompts(3, [9, 14, 3], seed=1)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=4, seed=8, ignore_eos=True)]

    def run(enforce_eager: bool):
        eng = LLMEngine(path, EngineConfig(device="cuda", dtype=torch.float32, block_size=4, num_blocks=64,
                                           max_model_len=64, enforce_eager=enforce_eager, cuda_graph_max_batch=8))
        assert (eng.runner.graphs is None) == enforce_eager
        assert enforce_eager or bool(eng.runner.graphs.greedy) == greedy_in_graph
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        return [done[i] for i in ids]

    assert run(False) == run(True)


def test_graph_staging_fills_the_static_buffers():
    """DecodeGraphs.stage (no capture needed, so this runs on CPU): ids/positions/slots/seq_lens
    land in the static views, padding rows store nothing and attend to nothing, the block table
    lands in its rows, and the extra sampling fields ride along."""
    from types import SimpleNamespace

    from dsquant.runtime.engine.cuda_graph import DecodeGraphs
    from dsquant.runtime.engine.model_runner import RunnerConfig

    cfg = RunnerConfig(device=torch.device("cpu"), dtype=torch.float32, block_size=4, max_model_len=40)
    graphs = DecodeGraphs(SimpleNamespace(config=cfg), max_batch=8)
    graphs.slot_mapping.fill_(123)
    graphs.seq_lens.fill_(77)
    packer = PackedCopy(cfg.device)
    table = [3, 4, 0, 7, 8, 9, 1, 0, 0]  # 3 rows of width 3
    extra = graphs.stage(packer, [11, 12, 13], [5, 9, 1], [13, 33, 5], [6, 10, 2], table, 3,
                         [([0.5, 1.0, 0.0], F32), ([1.0, 0.9, 1.0], F32), ([256, 5, 256], I32)])
    assert graphs.input_ids[:3].tolist() == [11, 12, 13] and graphs.positions[:3].tolist() == [5, 9, 1]
    assert graphs.slot_mapping.tolist() == [13, 33, 5] + [-1] * 5
    assert graphs.seq_lens.tolist() == [6, 10, 2] + [0] * 5
    assert graphs.block_tables[:3, :3].flatten().tolist() == table
    assert [t.tolist() for t in extra] == [[0.5, 1.0, 0.0], pytest.approx([1.0, 0.9, 1.0]), [256, 5, 256]]
    assert graphs.bucket[3] == 4 and graphs.bucket[8] == 8
