"""The capture names which Linears read one tensor (Captured.input_key), once, and keeps their
rows and Hessian once per input key; its rows are the fp32 of what each Linear saw."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsquant.calibrate.capture import LayerCapture


class _Fork(nn.Module):
    """a(x), b(x), c(x) on one x; d on a(x). With `fresh`, c reads a copy of x instead."""

    def __init__(self, k: int, fresh: bool = False):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(k, k, bias=False) for _ in range(4))
        self.fresh = fresh

    def forward(self, x):
        y = self.a(x)
        self.b(x)
        self.c(x.clone() if self.fresh else x)
        return self.d(y)


def test_linears_fed_one_tensor_get_one_key_rows_and_hessian():
    torch.manual_seed(0)
    mod = _Fork(16)
    gptq = {"p.a", "p.c", "p.d"}
    xs = [torch.randn(3, 20, 16) for _ in range(3)]
    with LayerCapture(mod, "p", gptq, max_rows=50, stride=2) as data, torch.no_grad():
        for x in xs:
            mod(x)
    assert data.input_key == {"p.a": "p.a", "p.b": "p.a", "p.c": "p.a", "p.d": "p.d"}
    assert set(data.rows) == {"p.a", "p.d"}
    want = torch.cat([x.reshape(-1, 16)[::2] for x in xs])[:50]
    assert data.counts == {"p.a": 50, "p.b": 50, "p.c": 50, "p.d": 50}
    assert data.hessians["p.a"] is data.hessians["p.c"] and data.hessians["p.d"] is not data.hessians["p.a"]
    assert data.hessians["p.a"].n == 180  # every token, counted once
    inputs = data.take_inputs(["p.a", "p.b", "p.c", "p.d"], "cpu")
    assert not data.rows
    assert inputs["p.a"] is inputs["p.b"] is inputs["p.c"] and torch.equal(inputs["p.a"], want)


def test_an_input_shared_on_one_batch_only_is_refused():
    mod = _Fork(8)
    with pytest.raises(RuntimeError, match="p.c: its input was p.a's"), torch.no_grad():
        with LayerCapture(mod, "p", set(), max_rows=100):
            mod(torch.randn(4, 8))
            mod.fresh = True
            mod(torch.randn(4, 8))


def test_rows_of_a_bf16_layer_are_the_fp32_of_what_it_saw():
    torch.manual_seed(1)
    mod = _Fork(32).to(torch.bfloat16)
    x = torch.randn(2, 30, 32).to(torch.bfloat16)
    with LayerCapture(mod, "p", {"p.a"}, max_rows=7, stride=3) as data, torch.no_grad():
        mod(x)
    rows = data.take_inputs(["p.a", "p.b"], "cpu")["p.b"]
    assert rows.dtype == torch.float32 and rows.is_contiguous()
    assert torch.equal(rows, x.reshape(-1, 32).float()[::3][:7])
    assert data.hessians["p.a"].h.dtype == torch.float32
