"""Compile a dsquant Triton kernel for sm_90 on a machine without a GPU and count its SASS.

    python scripts/sass_probe.py PRESET [--out DIR] [KEY=VALUE ...]

The presets and the compile live in dsquant/bench/sass.py (each kernel with the signature and the
integer specializations a real launch gets). KEY=VALUE overrides a constexpr (e.g. BLOCK_N=32,
PDL=True) or num_warps. Prints the registers, and for each loop (a backward branch with 60 or more
instructions) its length and opcode counts; writes the TTGIR and SASS under --out.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton

from dsquant.bench.sass import compile_sm90, loops, preset, sass_of


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE: a constexpr or num_warps")
    ap.add_argument("--out", default="/tmp/dsquant_sass")
    args = ap.parse_args()
    p = preset(args.preset)
    warps = None
    for kv in args.overrides:
        key, value = kv.split("=", 1)
        value = {"True": True, "False": False}.get(value, value)
        if key == "num_warps":
            warps = int(value)
        else:
            p.constexprs[key] = int(value) if isinstance(value, str) else value
    kernel = compile_sm90(p, warps)
    out = Path(args.out)
    tag = args.preset + "".join(f"_{kv}" for kv in args.overrides)
    sass, regs = sass_of(kernel, out, tag)
    (out / f"{tag}.ttgir").write_text(kernel.asm["ttgir"])
    (out / f"{tag}.sass").write_text(sass)
    count = sass.count(";")
    print(f"{tag}: {regs} warps {warps or p.num_warps}, {count} instructions (triton {triton.__version__}; "
          f"{os.path.relpath(out / tag)}.{{ttgir,sass}})")
    for lo, hi, ops in loops(sass):
        print(f"  loop {lo:#x}..{hi:#x}: {sum(ops.values())} instructions; "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main()
