"""Decode CUDA graphs under tensor parallelism, the parts that run without GPUs: rank 0's GRAPH payload
staged into a worker's graph buffers, the worker loop's CAPTURE and GRAPH commands, and the ranks'
agreement after capture (runtime/parallel/worker.py)."""
from types import SimpleNamespace

import torch

from dsquant.runtime.engine.cuda_graph import DecodeGraphs
from dsquant.runtime.engine.model_runner import RunnerConfig
from dsquant.runtime.engine.packed_copy import PackedCopy
from dsquant.runtime.parallel import worker
from dsquant.runtime.parallel.state import ParallelState


def _graphs(max_batch: int = 8) -> DecodeGraphs:
    cfg = RunnerConfig(device=torch.device("cpu"), dtype=torch.float32, block_size=4, max_model_len=64)
    return DecodeGraphs(SimpleNamespace(config=cfg), max_batch=max_batch)


def _staged_rank0(n: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    graphs = _graphs()
    ids = torch.randint(0, 30000, (n,), generator=g).tolist()
    pos = torch.randint(0, 60, (n,), generator=g).tolist()
    slots = torch.randint(0, 500, (n,), generator=g).tolist()
    lens = [p + 1 for p in pos]
    table = torch.randint(0, 120, (n * width,), generator=g).tolist()
    graphs.stage(PackedCopy(torch.device("cpu")), ids, pos, slots, lens, table, width, [])
    return graphs, (ids, pos, slots, lens, table)


def _poisoned() -> DecodeGraphs:
    graphs = _graphs()
    for t in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.seq_lens, graphs.block_tables):
        t.fill_(-12345)
    return graphs


def test_graph_payload_stages_rank0s_inputs_on_a_worker():
    n, width = 3, 5
    rank0, (ids, pos, slots, lens, table) = _staged_rank0(n, width)
    payload = worker.pack_graph_step(rank0, n, width)
    assert payload.dtype == torch.int64 and payload[:2].tolist() == [n, width]
    replays = []
    theirs = _poisoned()
    theirs.replay = lambda k: replays.append(k) or torch.full((k, 7), float(k))
    runner = SimpleNamespace(graphs=theirs, packed=PackedCopy(torch.device("cpu")))
    out = worker.run_graph_step(runner, payload)
    assert replays == [n] and out.shape == (n, 7)
    assert theirs.input_ids[:n].tolist() == ids and theirs.positions[:n].tolist() == pos
    assert theirs.slot_mapping.tolist() == slots + [-1] * (8 - n)  # padding rows store nothing
    assert theirs.seq_lens.tolist() == lens + [0] * (8 - n)  # and attend to nothing
    assert theirs.block_tables[:n, :width].flatten().tolist() == table
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(theirs, name)[:n], getattr(rank0, name)[:n]), name


def _scripted(monkeypatch, messages):
    """Feed serve_steps the (header, payload) pairs rank 0 would broadcast."""
    queue = []
    for header, payload in messages:
        queue.append(torch.tensor(header, dtype=torch.int64))
        if payload is not None:
            queue.append(payload)
    monkeypatch.setattr(worker, "broadcast_ints", lambda values, size, state: queue.pop(0))
    return queue


def test_worker_loop_captures_then_replays_graph_steps(monkeypatch):
    n, width = 2, 4
    rank0, _ = _staged_rank0(n, width, seed=1)
    payload = worker.pack_graph_step(rank0, n, width)
    theirs, replays, captures, agreed = _poisoned(), [], [], []
    theirs.replay = lambda k: replays.append(k)
    runner = SimpleNamespace(graphs=None, packed=PackedCopy(torch.device("cpu")))

    def capture(r):  # what ModelRunner.capture_cuda_graphs leaves behind on success
        captures.append(r)
        r.graphs = theirs

    monkeypatch.setattr(worker.ModelRunner, "capture_cuda_graphs", capture)
    monkeypatch.setattr(worker, "min_over_ranks", lambda v, state: agreed.append(v) or v)
    queue = _scripted(monkeypatch, [([worker.CAPTURE, 0, 0, 0], None),
                                    ([worker.STEP, payload.numel(), worker.GRAPH, 0], payload),
                                    ([worker.STOP, 0, 0, 0], None)])
    worker.serve_steps(runner, ParallelState(rank=1, world_size=2))
    assert not queue and captures == [runner] and agreed == [1] and replays == [n]
    assert torch.equal(theirs.input_ids[:n], rank0.input_ids[:n])


def test_a_rank_that_failed_to_capture_sends_every_rank_eager(monkeypatch):
    runner = SimpleNamespace(graphs=None)
    state = ParallelState(rank=1, world_size=2)
    timer = object()
    state.comm_times = timer
    seen = []

    def capture(r):
        seen.append(state.comm_times)  # no all-reduce timing inside a capture
        r.graphs = "captured here"

    monkeypatch.setattr(worker.ModelRunner, "capture_cuda_graphs", capture)
    monkeypatch.setattr(worker, "min_over_ranks", lambda v, s: 0)  # another rank failed
    worker.capture_on_every_rank(runner, state)
    assert runner.graphs is None and seen == [None] and state.comm_times is timer


def test_driver_stays_eager_on_cpu_and_with_the_switch_off(monkeypatch):
    sent = []
    monkeypatch.setattr(worker, "send", lambda *a, **k: sent.append(a))
    cfg = SimpleNamespace(device=torch.device("cpu"), enforce_eager=False)
    driver = SimpleNamespace(config=cfg, parallel=ParallelState(), graphs=None)
    monkeypatch.setattr(worker, "TP_CUDA_GRAPHS", True)
    worker.DriverRunner.capture_cuda_graphs(driver)  # CPU: nothing to capture
    cfg.device = torch.device("cuda")
    monkeypatch.setattr(worker, "TP_CUDA_GRAPHS", False)
    worker.DriverRunner.capture_cuda_graphs(driver)
    assert sent == [] and driver.graphs is None
