"""Host time per engine decode step, with the model forward replaced by a stub (CPU).

PYTHONPATH=. python scripts/host_overhead.py [--batch 1 8] [--steps 200] [--vocab 102400]
PYTHONPATH=. python scripts/host_overhead.py --batch 64 --long 4000 [--stop zzzq]

Builds the engine on a V2-Lite-shaped config shrunk to one tiny layer (vocab kept), then swaps
ModelRunner.forward for a stub that returns fixed random bf16 logits, so a step's time is the
engine's own host work: scheduler, block manager, runner.prepare, graph-less dispatch, sampling
setup, detokenizer. Sampling itself (argmax / softmax over the vocabulary) still runs, on the CPU,
where on a GPU it would be device work; `--vocab 256` shrinks it out of the way. Prints the median
and p90 of engine.step() per decode step, greedy and temperature 1, per batch size, and per step
the aten ops dispatched and the torch.tensor(...) calls made (on a GPU each op is a launch or a
copy, and each torch.tensor(..., device=cuda) a synchronizing host -> device copy).

--long N: each batch decodes N tokens greedily, detokenized with the bundled tokenizer (vocab 8192;
each row's logits depend on its input token, so the text varies), with the stop strings of --stop
(which never match: their checks still run); prints the step median around output tokens 100, N/4,
N/2 and N - 50, so host work that grows with the output length shows.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsquant.bench.random_model import V2_LITE, RandomCheckpointReader, make_config_dir
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=4096)


def stub_forward(runner, vocab: int, seed: int = 0):
    """Replace runner.forward: logits [S, vocab] bf16, fixed per row count (no model work)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(256, vocab, generator=g).to(torch.bfloat16)  # [256, V]

    def forward(input_ids, positions, ctx, logits_indices):
        return table[:logits_indices.shape[0]]  # [S, V]

    runner.forward = forward


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_step(engine) -> tuple[int, int]:
    """(aten ops, torch.tensor calls) of one engine.step()."""
    calls, make = [0], torch.tensor

    def counted(*a, **k):
        calls[0] += 1
        return make(*a, **k)

    torch.tensor = counted
    try:
        with CountOps() as mode:
            engine.step()
    finally:
        torch.tensor = make
    return mode.ops, calls[0]


def time_decode(engine, batch: int, steps: int, params: SamplingParams, prompt_len: int):
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(0, 30000, (prompt_len,), generator=g).tolist(), params)
    engine.step()  # the prefill(s)
    engine.step()
    counts = count_step(engine)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        # per output token: a multi-step burst returns several tokens per sequence
        per = max((len(o.new_token_ids) for o in outs), default=1)
        times += [dt / per] * per
    return times[5:steps], counts  # skip warm-up; the tail as requests finish together is kept short


def time_long(batch: int, total: int, stop: list[str]) -> list[tuple[int, float]]:
    """(output position, median step us) of `batch` greedy requests decoding `total` tokens."""
    from dsquant.assets import tokenizer_path

    vocab = 8192
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(Path(tmp) / "m", V2_LITE, "bf16", **TINY, vocab_size=vocab)
        engine = LLMEngine(path, EngineConfig(device="cpu", kernels=False, verify_checksums=False,
                                              max_model_len=total + 200, num_blocks=batch * ((total + 200) // 16 + 2),
                                              max_num_batched_tokens=1 << 17, max_num_seqs=256,
                                              tokenizer=str(tokenizer_path())),
                           reader=RandomCheckpointReader(path))
        table = torch.randn(256, vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

        def forward(input_ids, positions, ctx, rows):
            return table[input_ids[rows] % 256]  # [S, V]: the next token depends on the last

        engine.runner.forward = forward
        g = torch.Generator().manual_seed(batch)
        params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True, stop=stop or None)
        for _ in range(batch):
            engine.add_request(torch.randint(0, vocab, (100,), generator=g).tolist(), params)
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    marks = [m for m in (100, total // 4, total // 2, total - 50) if 20 <= m <= len(times) - 20]
    return [(m, statistics.median(times[m - 20:m + 20]) * 1e6) for m in marks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=V2_LITE["vocab_size"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per launch (multi_step.py)")
    ap.add_argument("--long", type=int, default=0, help="decode this many tokens per request (see above)")
    ap.add_argument("--stop", nargs="*", default=[], help="stop strings for --long")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.long:
        for batch in args.batch:
            rows = time_long(batch, args.long, args.stop)
            print(f"batch {batch:3d} stop {args.stop}: " + "  ".join(f"@{m}: {us:.0f} us" for m, us in rows))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(Path(tmp) / "m", V2_LITE, "bf16", **TINY, vocab_size=args.vocab)
        engine = LLMEngine(path, EngineConfig(device="cpu", kernels=False, verify_checksums=False,
                                              max_model_len=4096, num_blocks=2048,
                                              max_num_batched_tokens=1 << 17, max_num_seqs=256,
                                              num_scheduler_steps=args.num_scheduler_steps),
                           reader=RandomCheckpointReader(path))
        stub_forward(engine.runner, args.vocab)
        for batch in args.batch:
            for name, temp in (("greedy", 0.0), ("temperature 1", 1.0)):
                params = SamplingParams(max_tokens=args.steps + 8, temperature=temp, ignore_eos=True)
                t, (ops, tensors) = time_decode(engine, batch, args.steps, params, args.prompt_len)
                us = sorted(x * 1e6 for x in t)
                print(f"batch {batch:3d} {name:14s} per token median {statistics.median(us):8.1f} us  "
                      f"p90 {us[int(0.9 * len(us))]:8.1f} us  aten ops {ops:3d}  torch.tensor {tensors:2d}")


if __name__ == "__main__":
    main()
