"""Compile a dsquant Triton kernel for sm_90 on a machine without a GPU and count its SASS.

    python scripts/sass_probe.py PRESET [--out DIR] [KEY=VALUE ...]

Triton ships ptxas and cuobjdump, so `triton.compile` for GPUTarget("cuda", 90, 32) works on the CPU
machine. The presets give each kernel the signature and the integer specializations a real launch
gets (pointers and strides divisible by 16, unit strides as constants), since without them the
loads are not vectorized and the SASS is not the one the GPU runs. KEY=VALUE overrides a constexpr
(e.g. BLOCK_N=32) or num_warps. Prints the registers, and for each loop (a backward branch with
60 or more instructions) its length and opcode counts; writes the TTGIR and SASS under --out.

Presets: moe_gemv (moe_gemv._moe_gemv_kernel, gated, G 128), w4a16_gemv_sliced, w4a16_gemv_kblock,
fp8_gemv (A_MODE 0), fp8_gemv_kblock.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTR_DIV = "div16"


def _preset(name: str):
    """(kernel, [(arg, type)], constexprs, div16 args, unit-stride args, num_warps)."""
    if name == "moe_gemv":
        from dsquant.runtime.kernels.moe import moe_gemv as mod
        args = [(a, t) for a, t in zip(
            "a_ptr w_ptr s_ptr z_ptr out_ptr part_ptr counters_ptr topk_w_ptr ids_ptr".split(),
            "*bf16 *i32 *bf16 *u8 *bf16 *fp32 *i32 *fp32 *i32".split())]
        args += [(a, "i32") for a in "N K a_row_div stride_am stride_we stride_wc stride_se stride_s1 stride_s2 "
                 "stride_om split_k".split()]
        ce = dict(GROUP=128, GATED=True, ROUTED=False, BLOCK_N=16, LOADS_ONLY=False, ASM=True)
        return mod._moe_gemv_kernel, args, ce, ["N", "K", "stride_am", "stride_we", "stride_wc", "stride_se",
                                               "stride_s1", "stride_om"], ["stride_s2"], 1
    if name in ("w4a16_gemv_sliced", "w4a16_gemv_kblock"):
        from dsquant.runtime.kernels.gemm import w4a16_gemv, w4a16_gemv_kblock
        args = [(a, t) for a, t in zip("x_ptr qw_ptr s_ptr z_ptr perm_ptr out_ptr part_ptr counters_ptr".split(),
                                       "*bf16 *i32 *bf16 *u8 *i32 *bf16 *fp32 *i32".split())]
        args += [(a, "i32") for a in "M N num_chunks stride_xm stride_qn stride_sg stride_zg stride_om split_k".split()]
        div = ["N", "num_chunks", "stride_xm", "stride_qn", "stride_sg", "stride_zg", "stride_om"]
        if name == "w4a16_gemv_sliced":
            ce = dict(GROUP=128, BLOCK_N=64, BLOCK_M=1, HAS_PERM=False, ASM=True)
            return w4a16_gemv._w4a16_gemv_sliced_kernel, args, ce, div, [], 2
        ce = dict(GROUP=128, BLOCK_N=16, BLOCK_M=1, K_CHUNKS=16, HAS_PERM=False, ASM=True)
        return w4a16_gemv_kblock._w4a16_gemv_kblock_kernel, args, ce, div, [], 4
    if name == "fp8_gemv":
        from dsquant.runtime.kernels.gemm import fp8_gemv as mod
        args = [(a, t) for a, t in zip("x_ptr xs_ptr w_ptr ws_ptr out_ptr part_ptr counters_ptr".split(),
                                       "*fp8e4nv *fp32 *fp8e4nv *fp32 *bf16 *fp32 *i32".split())]
        args += [(a, "i32") for a in "M N K stride_xm stride_xsm stride_xsg stride_wn stride_wsn stride_om split_k".split()]
        ce = dict(A_MODE=0, BLOCK_N=32, BLOCK_M=1, EVEN_K=True)
        return mod._fp8_gemv_kernel, args, ce, ["N", "K", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn",
                                                "stride_om"], ["stride_xsg"], 4
    if name == "fp8_gemv_kblock":
        from dsquant.runtime.kernels.gemm import fp8_gemv_kblock as mod
        args = [(a, t) for a, t in zip("xq_ptr xs_ptr w_ptr ws_ptr out_ptr part_ptr counters_ptr".split(),
                                       "*fp8e4nv *fp32 *fp8e4nv *fp32 *bf16 *fp32 *i32".split())]
        args += [(a, "i32") for a in "M N K stride_xm stride_xsm stride_wn stride_wsn stride_om split_k".split()]
        ce = dict(BLOCK_N=16, BLOCK_M=1, K_BLOCKS=4)
        return mod._fp8_gemv_kblock_kernel, args, ce, ["N", "K", "stride_xm", "stride_xsm", "stride_wn",
                                                       "stride_wsn", "stride_om"], [], 4
    raise SystemExit(f"unknown preset {name!r}; see the module docstring")


def loops(sass: str):
    """(start, end, opcode Counter) of every backward branch's body of >= 60 instructions."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    for addr, text in ins:
        tgt = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < addr:
            body = [t for a, t in ins if int(tgt.group(1), 16) <= a <= addr]
            if len(body) >= 60:
                ops = Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.(?:SHL|MOV|WIDE|U32|X|128|64|U16|U8))?)",
                                       t).group(1) for t in body)
                yield int(tgt.group(1), 16), addr, ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE: a constexpr or num_warps")
    ap.add_argument("--out", default="/tmp/dsquant_sass")
    args = ap.parse_args()
    fn, sig_args, ce, div16, ones, warps = _preset(args.preset)
    for kv in args.overrides:
        key, value = kv.split("=", 1)
        value = {"True": True, "False": False}.get(value, value)
        if key == "num_warps":
            warps = int(value)
        else:
            ce[key] = int(value) if isinstance(value, str) else value
    names = [a for a, _ in sig_args]
    signature = {a: t for a, t in sig_args} | {a: "constexpr" for a in [*ones, *ce]}
    constexprs = {**ce, **{a: 1 for a in ones}}
    ptrs = [a for a, t in sig_args if t.startswith("*")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs + div16}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.preset + "".join(f"_{kv}" for kv in args.overrides)
    (out / f"{tag}.ttgir").write_text(kernel.asm["ttgir"])
    cubin = out / f"{tag}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    (out / f"{tag}.sass").write_text(sass)
    res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = " ".join(re.findall(r"REG:\d+", res))
    count = len(re.findall(r";", sass))
    print(f"{tag}: {regs} warps {warps}, {count} instructions (triton {triton.__version__}; "
          f"{os.path.relpath(out / tag)}.{{ttgir,sass}})")
    for lo, hi, ops in loops(sass):
        print(f"  loop {lo:#x}..{hi:#x}: {sum(ops.values())} instructions; "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main()
