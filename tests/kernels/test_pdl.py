"""Programmatic dependent launch (runtime/kernels/pdl.py): where each kernel's wait lands in its sm_90
SASS, compiled on the CPU with Triton's ptxas (dsquant/bench/sass.py), and when launches ask for it.

The contract the SASS must show (pdl.py): no global store or atomic before the wait (ACQBULK);
`release` (PREEXIT) after it; the weight prefetchers issue their weight loads before it, the others
no global load at all; with PDL off neither instruction is emitted."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsquant.bench.sass import tool_path
from dsquant.runtime.kernels import pdl

needs_ptxas = pytest.mark.skipif(not tool_path("ptxas").exists(), reason="Triton's ptxas is not installed")

# (preset, constexpr overrides, whether weights are loaded before the wait)
CASES = [
    ("w4a16_gemv_kblock", {}, True),
    ("fp8_gemv_kblock", {"FUSE_QUANT": False}, True),
    ("fp8_gemv_kblock", {"FUSE_QUANT": True}, True),
    ("moe_gemv", {"EARLY_IDS": False}, False),  # gate/up: its ids come from the launch right before
    ("moe_gemv_down", {"EARLY_IDS": True}, True),
    ("moe_pair_mma", {}, False),
    ("moe_pair_mma_down", {}, False),
    ("moe_pair_fp8", {}, False),
    ("router_logits", {}, True),
    ("mla_prepare", {}, True),
    ("mla_merge_uv", {}, True),
    ("rms_norm", {}, False),
    ("w4a16_gemv_sliced", {}, False),
    ("fp8_gemv", {}, False),
]
GLOBAL_WRITE = re.compile(r"^(STG|ST|ATOM|ATOMG|RED|REDG)(\.|$)")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every case compiled in one child process: the tests run under TRITON_INTERPRET=1, where
    @triton.jit gives interpreted functions that cannot be compiled."""
    cases = json.dumps([[name, overrides] for name, overrides, _ in CASES])
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-m", "dsquant.bench.sass", cases, str(tmp_path_factory.mktemp("sass"))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_ptxas
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{o}" for n, o, _ in CASES])
def test_wait_placement_in_sass(case, reports):
    name, _, prefetch = CASES[case]
    r = reports[case]
    assert r["waits"] and r["releases"] and r["waits"][0] < r["releases"][0], (name, r["waits"], r["releases"])
    before = r["before_wait"]
    assert not [t for t in before if GLOBAL_WRITE.match(t)], (name, before)
    loads = [t for t in before if t.startswith("LDG")]
    assert bool(loads) == prefetch, (name, loads)
    assert not r["off_has_pdl"], name


def test_launch_options(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(torch.device("cpu")) == {}
    assert pdl.launch(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch(torch.device("cuda", 0)) == {}  # the interpreter has no griddepcontrol


@pytest.mark.gpu
def test_launch_options_on_the_gpu(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = {"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}
    assert pdl.launch(torch.device("cuda")) == want


# kernels that read weights before their wait: their placement is checked in the SASS above
PREFETCHERS = {"_w4a16_gemv_kblock_kernel", "_fp8_gemv_kblock_kernel", "_moe_gemv_kernel", "_router_logits_kernel",
               "_mla_prepare_kernel", "_mla_merge_uv_kernel"}
HELPERS = {"_fused_steps", "_logits_block"}  # the jit helpers in which two of them wait
KERNELS = Path(pdl.__file__).parent


def _jit_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _launched_with_pdl(tree):
    """Names of kernels launched as NAME[grid](..., **pdl.launch(...)) (a `kernel = A if c else B`
    name counts for both)."""
    choices = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = node.value
            names = [v.body, v.orelse] if isinstance(v, ast.IfExp) else [v]
            choices[node.targets[0].id] = [n.id for n in names if isinstance(n, ast.Name)]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and any(k.arg is None and "pdl.launch" in ast.unparse(k.value) for k in node.keywords)):
            name = node.func.value.id
            yield from choices.get(name, [name])


def test_every_pdl_kernel_waits_first_or_is_a_checked_prefetcher():
    """A kernel with a PDL constexpr starts with pdl.enter(PDL) (after its docstring), or is one of the
    weight prefetchers whose SASS the test above checks; every kernel launched with pdl.launch's
    kwargs takes PDL."""
    seen, launched = {}, set()
    for path in sorted(KERNELS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in _jit_functions(tree):
            if "PDL" in [a.arg for a in fn.args.args]:
                seen[fn.name] = path.name
                body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if fn.name not in PREFETCHERS | HELPERS and fn.name not in ("wait", "release", "enter"):
                    assert ast.unparse(body[0]) == "pdl.enter(PDL)", (path.name, fn.name, ast.unparse(body[0]))
        launched.update(_launched_with_pdl(tree))
    assert PREFETCHERS <= set(seen), PREFETCHERS - set(seen)
    assert launched and launched <= set(seen), launched - set(seen)
    assert len(seen) >= 20, seen
