"""Where does the GPU engine's greedy decode leave the CPU reference on dsq-tiny-v3 fp8-block?

At the first differing token of each of the trained-accuracy test's prompts, the top-5 logprobs of:
the CPU float32 reference (full forward of prompt + agreed prefix), the CPU bf16 floor, the GPU
serving path (bf16, kernels, full forward), the GPU engine eager and with CUDA graphs, the GPU
engine with kernels off (pure torch on CUDA). Usage: python scripts/diag_fp8_decode.py OUT.json
"""
import importlib.util
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
spec = importlib.util.spec_from_file_location("acc", ROOT / "tests/runtime/test_gpu_trained_accuracy.py")
acc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acc)

from dsquant.models.layers import Backends  # noqa: E402
from dsquant.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from dsquant.runtime.loader import load_runtime_model  # noqa: E402
from dsquant.validate.runner import _runtime_model  # noqa: E402


def top5(logits: torch.Tensor) -> dict:
    lp = logits.float().log_softmax(-1)
    v, i = lp.topk(5)
    return {int(a): round(float(b), 4) for a, b in zip(i, v)}


def main(out: str) -> None:
    model, variant = sys.argv[2] if len(sys.argv) > 2 else "dsq-tiny-v3", sys.argv[3] if len(sys.argv) > 3 else "fp8-block"
    arts = acc.Artifacts(Path(tempfile.mkdtemp()))
    path = arts.path(model, variant)
    _, pool = arts.eval_data(model)
    prompts, ref, gap = acc._reference_prompts(path, pool)
    want = [o.token_ids for o in ref]
    engines = {}
    for name, cfg in {
        "gpu_graphs": acc._engine_config("cuda"),
        "gpu_eager": replace(acc._engine_config("cuda"), enforce_eager=True),
        "gpu_eager_sync": replace(acc._engine_config("cuda"), enforce_eager=True, async_scheduling=False),
        "gpu_torch": replace(acc._engine_config("cuda"), enforce_eager=True, kernels=False),
        "cpu_bf16": acc._engine_config("cpu", torch.bfloat16),
    }.items():
        try:
            eng = LLMEngine(path, cfg)
            engines[name] = acc._greedy(eng, prompts, logprobs=5)
            if hasattr(eng, "close"):
                eng.close()
            del eng
        except Exception as e:  # noqa: BLE001 - a diagnostic: record and go on
            engines[name] = repr(e)
    fwd = {"cpu_f32": _runtime_model(path, "cpu"), "gpu_serving": _runtime_model(path, "cuda"),
           "cpu_bf16_torch": load_runtime_model(path, Backends(), dtype=torch.bfloat16, device="cpu")}
    report = {"model": model, "variant": variant, "gap": gap, "prompts": []}
    for p, (prompt, w) in enumerate(zip(prompts, want)):
        rows = {"reference": w}
        for name, outs in engines.items():
            rows[name] = outs if isinstance(outs, str) else outs[p].token_ids
        first = min((acc._agreed(w, t) for n, t in rows.items() if isinstance(t, list) and n != "reference"), default=16)
        at = min(first, len(w) - 1)
        ids = torch.tensor([prompt + w[:at]])
        logits = {}
        for name, m in fwd.items():
            dev = "cuda" if name.startswith("gpu") else "cpu"
            with torch.no_grad():
                logits[name] = top5(m(ids.to(dev))[0, -1].float().cpu())
        for name, outs in engines.items():
            if not isinstance(outs, str) and at < len(outs[p].logprobs):
                logits[name] = {int(k): round(float(v), 4) for k, v in outs[p].logprobs[at][1].items()}
        logits["reference_engine"] = {int(k): round(float(v), 4) for k, v in ref[p].logprobs[at][1].items()}
        report["prompts"].append({"first_difference": at, "tokens": rows, "top5_at_difference": logits})
        print(json.dumps(report["prompts"][-1]))
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
