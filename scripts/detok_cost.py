"""Host time an engine spends post-processing each output token, text decoded at each step or deferred (CPU).

PYTHONPATH=. python scripts/detok_cost.py [--batch 64] [--tokens 256] [--steps 1 8] [--rounds 3]

The engine of scripts/host_overhead.py (V2-Lite-shaped config shrunk to one tiny layer, the bundled
tokenizer, a stub forward whose next token depends on the last) decodes `--tokens` tokens for each of
`--batch` greedy requests without stop strings; LLMEngine._finish_step (tokens placed, blocks registered,
stop checks, detokenization, outputs built) is timed and divided by the tokens. Each round runs every
(decode steps per launch, text) pair: "eager" decodes each step's text with IncrementalDetokenizer.add,
"deferred" hands the tokens to IncrementalDetokenizer.defer (outputs.LazyDelta, the engine's path for
requests without stop strings), and nothing reads the text, as in a benchmark.
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch

import dsquant.runtime.engine.llm_engine as llm_engine
from dsquant.assets import tokenizer_path
from dsquant.bench.random_model import V2_LITE, RandomCheckpointReader, make_config_dir
from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams

from host_overhead import TINY

VOCAB = 8192


def finish_us_per_token(path: Path, batch: int, tokens: int, steps: int, lazy: bool) -> float:
    llm_engine.IncrementalDetokenizer = lambda tok, stop, **_: IncrementalDetokenizer(tok, stop, lazy=lazy)
    try:
        engine = LLMEngine(path, EngineConfig(device="cpu", kernels=False, verify_checksums=False,
                                              max_model_len=tokens + 200, num_blocks=batch * ((tokens + 200) // 16 + 2),
                                              max_num_batched_tokens=1 << 17, max_num_seqs=256,
                                              num_scheduler_steps=steps, tokenizer=str(tokenizer_path())),
                           reader=RandomCheckpointReader(path))
        table = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        engine.runner.forward = lambda ids, positions, ctx, rows: table[ids[rows] % 256]  # [S, V]
        spent, finish = [0.0], engine._finish_step

        def timed(step):
            t = time.perf_counter()
            out = finish(step)
            spent[0] += time.perf_counter() - t
            return out

        engine._finish_step = timed
        g = torch.Generator().manual_seed(batch)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(torch.randint(0, VOCAB, (100,), generator=g).tolist(), params)
        while engine.has_unfinished():
            engine.step()
        return spent[0] / (batch * tokens) * 1e6
    finally:
        llm_engine.IncrementalDetokenizer = IncrementalDetokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(Path(tmp) / "m", V2_LITE, "bf16", **TINY, vocab_size=VOCAB)
        for r in range(args.rounds):
            row = [f"{s} steps {'deferred' if lazy else 'eager'} {finish_us_per_token(path, args.batch, args.tokens, s, lazy):.2f}"
                   for s in args.steps for lazy in (False, True)]
            print(f"round {r}: us per token: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
