"""Tensor-parallel shards (runtime/parallel/linear.shard_linear) of realistic weights
(tests/realistic_weights.py: one scale per FP8 block / INT4 group over three orders of magnitude,
outlier input channels, zero rows, a zero tile), in every format, over 2 and 4 ranks, column and
row parallel; single process, each rank's shard built in turn from the full checkpoint.

Per rank: the shard holds exactly its slice (FP8: the e4m3 codes bit for bit and, element by
element, the block scale the unsplit weight has there; every format: the dequantized weight equal
to the slice of the float64 reference rebuilt from the quantizer's codes). Outputs: the ranks'
column outputs concatenated, and their row partial sums added, equal the unsharded layer's
output and x @ W^T in float64 (x through FP8's W8A8 activation quantization where the format has
it), per block of 128 output channels. Row splits of W8A8 layers off 128-channel groups quantize
x over the global groups through an all-reduce of the group amax, emulated here in two passes
(the ranks' contributions collected, then their max handed to every rank).

Slices not on 128 boundaries are not refused: a local FP8 block inside one checkpoint block (64
rows of a 128-row block) keeps FP8; one straddling two blocks, or INT4 packs / groups that do
not fit, make every rank load that layer dense (ActQuantDenseMethod for FP8, so x is still
quantized as the unsplit layer quantizes it): EXPECT names the method each case must end with.
On CUDA (gpu-marked) the same shards run the kernels (W4A16, FP8 block with the cuBLAS scale
layout) in bf16.
"""
from __future__ import annotations

import pytest
import torch

from dsquant.formats.fp8_block import FP8_BLOCK, fp8_activation_roundtrip, fp8_block_shape
from dsquant.runtime.layers.linear import LinearFactory
from dsquant.runtime.parallel import linear as tp_linear
from dsquant.runtime.parallel.linear import COLUMN, ROW, ActQuantDenseMethod, Part, RowShardFP8Method, shard_linear
from dsquant.runtime.parallel.state import ParallelState

from conftest import DictReader
from tests.quantized_weights import QuantizedWeight, realistic_quantized
from tests.realistic_weights import max_block_rel_err, realistic_activations, realistic_weight

P = "model.layers.0.mlp.down_proj"
B = FP8_BLOCK


def quantized(fmt: str, n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    if fmt == "dense":
        w = realistic_weight(n, k, seed=seed)
        return QuantizedWeight({"weight": w}, w.double(), {})
    return realistic_quantized(fmt, n, k, seed=seed, group=group)


def fill(layer, tensors: dict, device, dtype):
    """The checkpoint tensors into a meta QuantLinear, as the loader puts them (a dense weight
    in the model dtype, packed tensors as stored); not yet processed."""
    for name, meta in list(layer._parameters.items()):
        t = tensors[name]
        assert tuple(t.shape) == tuple(meta.shape), name
        if layer.method.name == "dense":
            t = t.to(dtype)
        layer._parameters[name] = torch.nn.Parameter(t.to(device), requires_grad=False)
    layer.compute_dtype = dtype
    return layer


def process(layer):
    layer.method.process_weights_after_loading(layer)  # CPU: dequantize; CUDA: repack / scale layout
    return layer


class AllReduceMax:
    """runtime.parallel.state.all_reduce_max over ranks run one after another in this process:
    pass 1 records each rank's tensor (and returns it); pass 2 gives every rank their max."""

    def __init__(self):
        self.seen, self.result = [], None

    def __call__(self, t, state):
        if self.result is None:
            self.seen.append(t.clone())
            return t
        return t.copy_(self.result)

    def finish_pass(self):
        if self.seen:
            self.result = torch.stack(self.seen).amax(0)


def shards(qw: QuantizedWeight, n: int, k: int, kind: str, world: int, device, dtype):
    """Every rank's sharded QuantLinear (rank order) and the unsharded one, filled as the runtime
    loads them (the factory picks the method from quantization_config), not yet processed."""
    factory = LinearFactory(qw.config or None)
    full_tensors = {f"{P}.{a}": t for a, t in qw.tensors.items()}
    reader = DictReader(full_tensors)
    full = fill(factory(P, k, n, False), qw.tensors, device, dtype)
    parts = [Part.of(n if kind == COLUMN else k, r, world) for r in range(world)]
    layers = []
    for rank in range(world):
        layer = factory(P, k, n, False)
        rules, hidden = shard_linear(layer, kind, parts, ParallelState(rank, world), reader,
                                     lambda key: qw.dense.float())
        local = {name: rules[f"{P}.{name}"]() if f"{P}.{name}" in rules else full_tensors[f"{P}.{name}"]
                 for name in layer._parameters}
        layers.append(fill(layer, local, device, dtype))
    return layers, full, parts


def w8a8(qw: QuantizedWeight) -> bool:
    return qw.config.get("quant_method") == "fp8" or qw.config.get("format") == "float-quantized"


def reference(qw: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T in float64 on x's device (x quantized per token per 128 channels for W8A8)."""
    xs = fp8_activation_roundtrip(x.float(), dtype=torch.float64) if w8a8(qw) else x.double()
    return xs @ qw.dense.to(x.device).t()


def check_slices(qw: QuantizedWeight, layers, parts, kind: str, n: int, k: int):
    """Each rank holds its slice: dequantized weight exact; FP8 codes and per-element scales."""
    scale_elem = None
    if qw.tensors.get("weight", torch.empty(0)).dtype == torch.float8_e4m3fn:
        s = qw.tensors.get("weight_scale_inv", qw.tensors.get("weight_scale"))
        scale_elem = s.repeat_interleave(B, 0)[:n].repeat_interleave(B, 1)[:, :k]  # [N, K]
    for rank, (layer, part) in enumerate(zip(layers, parts)):
        cut = (lambda t: t[part.slice]) if kind == COLUMN else (lambda t: t[:, part.slice])
        if layer.method.name in ("fp8_block", "ct_fp8"):
            nl, kl = layer.weight.shape
            local = getattr(layer, "weight_scale_inv", None)
            local = (local if local is not None else layer.weight_scale).cpu()
            assert tuple(local.shape) == fp8_block_shape(nl, kl)
            got = local.repeat_interleave(B, 0)[:nl].repeat_interleave(B, 1)[:, :kl]
            assert torch.equal(got, cut(scale_elem)), f"rank {rank}: FP8 block scales of the shard misplaced"
            assert torch.equal(layer.weight.view(torch.uint8).cpu(), cut(qw.tensors["weight"]).view(torch.uint8))
        got = layer.method.dequantized_weight(layer, torch.float32).cpu()
        want = cut(qw.dense).float()
        if layer.method.name == "dense":
            want = want.to(layer.weight.dtype).float()  # loaded in the model dtype
        assert torch.equal(got, want), f"rank {rank}: dequantized shard is not its slice"


# fmt, N, K, kind, worlds, group, the method every rank must end with (None: the checkpoint's)
CASES = [
    ("dense", 256, 320, COLUMN, (2, 4), 128, None),
    ("dense", 192, 384, ROW, (2, 4), 128, None),
    # FP8 column: whole blocks (kb = 5, not a multiple of 4: the cuBLAS scale pitch), 64 rows
    # inside one block (TP4 of 256), rows straddling blocks (TP2 of 384: [192, 384)) -> dense
    ("fp8", 1024, 640, COLUMN, (2, 4), 128, None),
    ("fp8", 512, 256, COLUMN, (2,), 128, None),  # a square 2 x 2 scale per rank: a transpose would fit
    ("fp8", 256, 384, COLUMN, (4,), 128, None),
    ("fp8", 384, 256, COLUMN, (2,), 128, "dense"),
    ("fp8", 300, 256, COLUMN, (4,), 128, "dense"),  # uneven (75 rows a rank), partial edge block
    # FP8 row: whole groups; 64 channels inside a group (RowShardFP8Method, amax all-reduced);
    # 96 / 75 channels straddling groups -> dense, x still quantized over the global groups
    ("fp8", 384, 1024, ROW, (2, 4), 128, None),
    ("fp8", 256, 256, ROW, (4,), 128, None),
    ("fp8", 256, 384, ROW, (4,), 128, "dense"),
    ("fp8", 256, 300, ROW, (4,), 128, "dense"),
    # AWQ / GPTQ: N packs of 8, K re-grouped to gcd(G, start, size) >= 32
    ("awq", 512, 512, COLUMN, (2, 4), 128, None),
    ("awq", 200, 256, COLUMN, (4,), 128, "dense"),  # 50 columns a rank: not whole int32 packs
    ("awq", 256, 512, ROW, (2, 4), 128, None),
    ("awq", 256, 384, ROW, (4,), 128, None),  # 96 channels a rank: groups of 32
    ("awq", 256, 256, ROW, (4,), 64, None),  # 64 channels, G = 64
    ("gptq", 512, 512, COLUMN, (2, 4), 128, None),
    ("gptq", 256, 512, ROW, (2, 4), 128, None),
    ("gptq", 256, 384, ROW, (4,), 128, None),
    ("gptq", 256, 320, ROW, (2,), 64, None),  # 160 channels a rank: groups of 32
    ("gptq_act_order", 256, 256, COLUMN, (2, 4), 64, None),  # g_idx kept whole
    ("gptq_act_order", 256, 256, ROW, (2,), 64, "dense"),  # a rank's channels reach every group
    # compressed-tensors: INT4 packs of 8 along K (codes) and N (zero points), K re-grouped as AWQ;
    # FP8 blocks as fp8's, W8A8 row splits off the 128 grid loaded dense (ActQuantDenseMethod)
    ("ct_int4", 512, 512, COLUMN, (2, 4), 128, None),
    ("ct_int4", 200, 256, COLUMN, (4,), 128, "dense"),  # 50 rows a rank: not whole zero-point packs
    ("ct_int4", 256, 512, ROW, (2, 4), 128, None),
    ("ct_int4", 256, 384, ROW, (4,), 128, None),  # 96 channels a rank: groups of 32
    ("ct_int4_act_order", 256, 256, COLUMN, (2, 4), 64, None),  # weight_g_idx kept whole
    ("ct_int4_act_order", 256, 256, ROW, (2,), 64, "dense"),  # a rank's channels reach every group
    ("ct_fp8", 1024, 640, COLUMN, (2, 4), 128, None),
    ("ct_fp8", 384, 256, COLUMN, (2,), 128, "dense"),
    ("ct_fp8", 384, 1024, ROW, (2, 4), 128, None),
    ("ct_fp8", 256, 256, ROW, (4,), 128, "fp8_block"),  # 64 channels a rank: fp8_block's RowShardFP8Method
    ("ct_fp8", 256, 384, ROW, (4,), 128, "dense"),  # 96 channels a rank straddle blocks
]
PARAMS = [pytest.param(fmt, n, k, kind, world, group, expect, id=f"{fmt}-{n}x{k}-{kind}-tp{world}")
          for fmt, n, k, kind, worlds, group, expect in CASES for world in worlds]


def check_case(fmt, n, k, kind, world, group, expect, device, dtype, m, tol_full, tol_ref, monkeypatch):
    qw = quantized(fmt, n, k, group, seed=n + k + world)
    reduce_max = AllReduceMax()
    monkeypatch.setattr(tp_linear, "all_reduce_max", reduce_max)
    layers, full, parts = shards(qw, n, k, kind, world, device, dtype)
    want = expect or full.method.name
    for layer in layers:
        assert layer.method.name == want, f"{layer.method.name} != {want}"
        if w8a8(qw) and want == "dense":
            assert isinstance(layer.method, ActQuantDenseMethod)  # still W8A8 on its activations
    if w8a8(qw) and kind == ROW and want == "fp8_block" and any(p.start % B or p.size % B for p in parts):
        assert all(isinstance(layer.method, RowShardFP8Method) for layer in layers)
    check_slices(qw, layers, parts, kind, n, k)
    for layer in layers + [full]:
        process(layer)

    x = realistic_activations(m, k, seed=world, device=device, dtype=dtype)
    xs = [x if kind == COLUMN else x[:, p.slice] for p in parts]
    for _ in range(2):  # pass 1: the amax all-reduce collects; pass 2: every rank sees the max
        outs = [layer(xr) for layer, xr in zip(layers, xs)]
        reduce_max.finish_pass()
    got = torch.cat(outs, -1) if kind == COLUMN else torch.stack([o.double() for o in outs]).sum(0)
    assert got.shape == (m, n)
    unsharded = full(x)
    err_full = max_block_rel_err(got, unsharded)
    err_ref = max_block_rel_err(got, reference(qw, x))
    assert err_full < tol_full, f"sharded vs unsharded layer: worst 128-channel block error {err_full:.3g}"
    assert err_ref < tol_ref, f"sharded vs float64 x @ W^T: worst 128-channel block error {err_ref:.3g}"
    assert max_block_rel_err(unsharded, reference(qw, x)) < tol_ref  # the unsharded layer itself


@pytest.mark.parametrize("fmt,n,k,kind,world,group,expect", PARAMS)
def test_tp_shards_of_realistic_weights(fmt, n, k, kind, world, group, expect, monkeypatch):
    # float32 on the CPU: only the summation order differs from the unsharded layer
    check_case(fmt, n, k, kind, world, group, expect, "cpu", torch.float32, 5, 1e-5, 1e-5, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 80])
@pytest.mark.parametrize("fmt,n,k,kind,world,group,expect", PARAMS)
def test_tp_shards_of_realistic_weights_gpu(fmt, n, k, kind, world, group, expect, m, monkeypatch):
    # bf16 kernels: each rank's output is rounded to bf16 before the sum (the all-reduce's input)
    check_case(fmt, n, k, kind, world, group, expect, "cuda", torch.bfloat16, m, 2e-2, 2e-2, monkeypatch)
