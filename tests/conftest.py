"""Test set-up shared by every test.

Triton kernels run under the interpreter when no CUDA device is present. TRITON_INTERPRET must
be set before any kernel module is imported (triton.jit reads it at decoration time), so it is
set here, at collection start. Tests marked `gpu` skip without CUDA.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """The device kernel tests run on: cuda when present, else cpu (Triton interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
