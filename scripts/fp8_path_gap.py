"""How far the FP8 kernel path is from the torch reference, next to how far FP8 is from BF16.

    python scripts/fp8_path_gap.py OUT.json [--seeds 4] [--schemes fp8,awq] [--dtypes bfloat16,float32]

On tiny random DeepSeek-V2 models (tests/runtime/conftest.py, experts 128 wide so the FP8 grouped
GEMMs run), per source seed and scheme:
- free-running greedy: the reference (kernels=False) and the kernel path (Triton, CUDA graphs),
  8 new tokens with top-5 logprobs per step; first diverging step and whether vLLM's
  check_logprobs_close rule holds (at the first difference each token is in the other's top 5);
- teacher-forced: prompt logprobs (top 5) on prompt + the reference's tokens through the
  reference, the kernel path and the dense BF16 source; mean / max |delta logprob| of the scored
  tokens and top-1 agreement, kernel vs reference ("path gap") and source vs reference
  ("quantization gap").
Needs CUDA. A diagnostic for tests/runtime/test_kernel_path.py's FP8 criterion.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "runtime"), str(ROOT)]

from conftest import build_hf, random_prompts  # noqa: E402
from test_quantized_checkpoints import write_pair  # noqa: E402

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dsquant.runtime.engine.sequence import SamplingParams  # noqa: E402

PROMPTS = random_prompts(3, [9, 14, 3], seed=1)


def run(path, kernels: bool, params: SamplingParams, prompts, dtype=torch.bfloat16) -> list:
    eng = LLMEngine(path, EngineConfig(device="cuda", dtype=dtype, block_size=4, num_blocks=128,
                                       max_model_len=64, max_num_batched_tokens=16, kernels=kernels,
                                       enforce_eager=not kernels))
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[i] for i in ids]


def free_running(quant, dtype) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    ref, ker = run(quant, False, params, PROMPTS, dtype), run(quant, True, params, PROMPTS, dtype)
    first, close = [], True
    for r, k in zip(ref, ker):
        step = next((i for i, (a, b) in enumerate(zip(r.token_ids, k.token_ids)) if a != b), None)
        first.append(step)
        if step is not None:
            close &= r.token_ids[step] in k.logprobs[step][1] and k.token_ids[step] in r.logprobs[step][1]
    return {"ref_tokens": [r.token_ids for r in ref], "first_diff": first, "logprobs_close": close}, ref


def scored(outs) -> list[list[tuple[float, int]]]:
    """Per sequence: (logprob of the scored token, argmax token) at every prompt position after the first."""
    return [[(e[0], max(e[1], key=e[1].get)) for e in o.prompt_logprobs[1:]] for o in outs]


def gap(a, b) -> dict:
    d = [abs(x[0] - y[0]) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    agree = [x[1] == y[1] for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return {"mean": sum(d) / len(d), "max": max(d), "top1_agree": sum(agree) / len(agree), "n": len(d)}


def main(out_json: str, seeds: int = 4, schemes: str = "fp8,awq", dtypes: str = "bfloat16,float32") -> None:
    rows = []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            build_hf("deepseek_v2", seed=seed, moe_intermediate_size=128).save_pretrained(src)
            for scheme in schemes.split(","):
                work = Path(tmp) / scheme
                work.mkdir()
                quant, _ = write_pair(src, work, scheme)
                for dtype in (getattr(torch, d) for d in dtypes.split(",")):
                    row, ref = free_running(quant, dtype)
                    forced = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
                    tf = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=5)
                    s_ref = scored(run(quant, False, tf, forced, dtype))
                    s_ker = scored(run(quant, True, tf, forced, dtype))
                    s_src = scored(run(src, False, tf, forced, dtype))
                    row.update(seed=seed, scheme=scheme, dtype=str(dtype), path_gap=gap(s_ker, s_ref),
                               quant_gap=gap(s_src, s_ref))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(out_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = dict(zip(args[1::2], args[2::2]))
    main(args[0], int(opts.get("--seeds", 4)), opts.get("--schemes", "fp8,awq"),
         opts.get("--dtypes", "bfloat16,float32"))
