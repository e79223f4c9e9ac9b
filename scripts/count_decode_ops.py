"""Count the kernels one batch-1 decode step launches, per decoder layer, on the kernel path.

    PYTHONPATH=. python scripts/count_decode_ops.py [--json OUT] [--v3]   (from the repo root)

Runs on CPU: a tiny random model with DeepSeek-V2-Lite's structure (MLA without q LoRA, first
layer dense, 64 routed experts top-6 + 2 shared; --v3: V3's sigmoid / noaux_tc routing, q LoRA,
256 experts top-8) is loaded through LLMEngine(kernels=True) in fp32, which builds it of the CUDA
path's fused ops (layers/fused.py), one prompt is prefilled and the next decode step is
counted. Every aten op that would be a CUDA kernel (views, empty allocations and other
metadata-only ops excluded) and every Triton launch (ops inside a launch are the interpreter's,
not counted) is charged to the innermost module that ran it, so the per-layer table says which
part of the layer each kernel belongs to. The counts are those of the GPU's eager step, which a
CUDA graph replays one kernel per entry.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
            "alias", "lift_fresh", "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride",
            "sym_numel", "sym_storage_offset", "resize_", "set_", "_unsafe_view"}

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, vocab_size=512, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1)
V3_ROUTING = dict(q_lora_rank=32, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                  topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                  routed_scaling_factor=2.5, n_shared_experts=1)


class KernelCounter(TorchDispatchMode):
    """Charges each kernel-launching aten op and each Triton launch to `self.scope` (a module path)."""

    def __init__(self):
        super().__init__()
        self.scope = ["outside"]
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.paused = 1  # > 0: not counting (outside the `with`, or inside a Triton launch)

    def __enter__(self):
        self.paused -= 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.paused += 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # under inference_mode composite ops (linear, einsum, to) reach the mode undecomposed:
            # decompose them here so their parts (mm, bmm, _to_copy) are what gets counted
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.overloadpacket.__name__
        if self.paused <= 0 and not func.is_view and name not in FREE_OPS:
            self.counts[self.scope[-1]][f"aten.{name}"] += 1
        return func(*args, **kwargs)

    def triton_launch(self, kernel_name: str) -> None:
        if self.paused <= 0:
            self.counts[self.scope[-1]][f"triton.{kernel_name}"] += 1


def _hook_modules(model, counter: KernelCounter) -> None:
    for name, module in model.named_modules():
        if not name:
            continue
        scope = name.removeprefix("model.")
        module.register_forward_pre_hook(lambda m, a, s=scope: counter.scope.append(s))
        module.register_forward_hook(lambda m, a, o: counter.scope.pop() and None)  # None: keep o


def _patch_triton(counter: KernelCounter) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if not kwargs.get("warmup"):  # a warm-up call compiles (here: returns) without launching
            counter.triton_launch(self.fn.__name__)
        counter.paused += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused -= 1
    InterpretedFunction.run = counted_run


def count_decode_step(config: dict, dtype: torch.dtype = torch.float32,
                      prompt_len: int = 5) -> dict[str, collections.Counter]:
    """{module path: Counter(op -> launches)} of one batch-1 decode step after a prompt."""
    from dsquant.bench.random_model import V2_LITE, RandomCheckpointReader, make_config_dir
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
    from dsquant.runtime.engine.sequence import SamplingParams

    counter = KernelCounter()
    _patch_triton(counter)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(tmp, {**V2_LITE, **config})
        reader = RandomCheckpointReader(path, std=0.2)
        eng = LLMEngine(path, EngineConfig(device="cpu", dtype=dtype, kernels=True, block_size=4,
                                           num_blocks=16, max_model_len=64, enforce_eager=True), reader=reader)
    model = eng.model  # built of the kernel-path modules (layers/fused.py), as on CUDA
    _hook_modules(model, counter)
    eng.add_request(list(range(2, 2 + prompt_len)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()  # prefill, not counted
    with counter:
        eng.step()  # one decode token
    return counter.counts


def per_layer(counts: dict[str, collections.Counter]) -> dict[str, dict]:
    """Group module paths under their decoder layer: {layers.i: {sub-module: {op: n}}, ...}."""
    out: dict[str, dict] = {}
    for scope, ops in counts.items():
        parts = scope.split(".")
        if parts[0] == "layers":
            layer, sub = ".".join(parts[:2]), ".".join(parts[2:]) or "(layer)"
        else:
            layer, sub = "outside layers", scope
        out.setdefault(layer, {})[sub] = dict(sorted(ops.items()))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the per-layer table here")
    ap.add_argument("--v3", action="store_true", help="V3 routing (sigmoid, noaux_tc, 256 experts top-8)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="activation dtype (bf16, as served, shows the casts; the interpreter's bf16 "
                         "numbers are wrong, which does not change the count)")
    args = ap.parse_args(argv)
    table = per_layer(count_decode_step({**TINY, **(V3_ROUTING if args.v3 else {})},
                                        getattr(torch, args.dtype)))
    for layer in sorted(table, key=lambda k: (not k.startswith("layers"), k)):
        subs = table[layer]
        total = sum(sum(ops.values()) for ops in subs.values())
        print(f"{layer}: {total} kernels")
        for sub, ops in sorted(subs.items()):
            listed = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in ops.items())
            print(f"  {sub:32s} {sum(ops.values()):3d}  {listed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
