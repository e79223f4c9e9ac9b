"""Compile a dsquant Triton kernel for sm_90 on a machine without a GPU and read its SASS.

Triton ships ptxas and cuobjdump, so `triton.compile` for GPUTarget("cuda", 90, 32) works on the CPU
machine. Each preset gives a kernel the signature and the integer specializations a real launch
gets (pointers and strides divisible by 16, unit strides as constants), since without them the
loads are not vectorized and the SASS is not the one the GPU runs. Used by scripts/sass_probe.py
(instruction counts of the hot loops) and by tests/kernels/test_pdl.py (where the PDL wait sits).

Presets: moe_gemv (moe_gemv._moe_gemv_kernel, gated, G 128), moe_gemv_down (routed, not gated),
moe_pair_mma, moe_pair_mma_down (moe_pair_mma._moe_pair_mma_kernel, likewise, BLOCK_N 64, 4 warps),
moe_pair_fp8 (moe_pair_mma._moe_pair_fp8_kernel, gated),
w4a16_gemv_sliced, w4a16_gemv_kblock, w4a16_mma (BLOCK_N 64, BLOCK_M 16, 2 warps), fp8_gemv (A_MODE 0),
fp8_gemv_kblock, rms_norm, router_logits, mla_prepare, mla_merge_uv.
"""
from __future__ import annotations

import inspect
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@dataclass
class Preset:
    kernel: object  # a triton JITFunction
    args: list  # [(name, type)] of the runtime arguments, in order
    constexprs: dict
    div16: list  # integer arguments specialized as multiples of 16
    ones: list  # stride arguments specialized to 1 (constexpr)
    num_warps: int


def _typed(names: str, types: str) -> list:
    return list(zip(names.split(), types.split()))


def _ints(names: str) -> list:
    return [(a, "i32") for a in names.split()]


def preset(name: str) -> Preset:
    """The named kernel with its launch's signature (see the module docstring)."""
    if name in ("moe_gemv", "moe_gemv_down"):
        from dsquant.runtime.kernels.moe import moe_gemv as mod
        args = _typed("a_ptr w_ptr s_ptr z_ptr out_ptr part_ptr counters_ptr topk_w_ptr ids_ptr perm_ptr",
                      "*bf16 *i32 *bf16 *u8 *bf16 *fp32 *i32 *fp32 *i32 *i32")
        args += _ints("N K a_row_div stride_am stride_we stride_wc stride_se stride_s1 stride_s2 stride_om stride_pe "
                      "split_k")
        gated = name == "moe_gemv"
        ce = dict(GROUP=128, GATED=gated, ROUTED=not gated, BLOCK_N=16, LOADS_ONLY=False, ASM=True, PDL=False,
                  EARLY_IDS=False, HAS_PERM=False)
        return Preset(mod._moe_gemv_kernel, args, ce, ["N", "K", "stride_am", "stride_we", "stride_wc", "stride_se",
                                                       "stride_s1", "stride_om"], ["stride_s2", "stride_pe"], 1)
    if name in ("moe_pair_mma", "moe_pair_mma_down"):
        from dsquant.runtime.kernels.moe import moe_pair_mma as mod
        args = _typed("a_ptr w_ptr s_ptr z_ptr out_ptr part_ptr counters_ptr topk_w_ptr ids_ptr perm_ptr",
                      "*bf16 *i32 *bf16 *u8 *bf16 *fp32 *i32 *fp32 *i32 *i32")
        args += _ints("N K a_row_div stride_am stride_we stride_wc stride_se stride_s1 stride_s2 stride_om stride_pe "
                      "split_k")
        gated = name == "moe_pair_mma"
        ce = dict(GROUP=128, GATED=gated, ROUTED=not gated, MAGIC=0x4300, PAIRED=True, BLOCK_N=64, BLOCK_M=16,
                  PDL=False, HAS_PERM=False)
        return Preset(mod._moe_pair_mma_kernel, args, ce, ["N", "K", "stride_am", "stride_we", "stride_wc",
                                                           "stride_se", "stride_s1", "stride_om"], ["stride_s2",
                                                                                                   "stride_pe"], 4)
    if name == "moe_pair_fp8":
        from dsquant.runtime.kernels.moe import moe_pair_mma as mod
        args = _typed("a_ptr as_ptr w_ptr s_ptr out_ptr part_ptr counters_ptr topk_w_ptr ids_ptr",
                      "*fp8e4nv *fp32 *fp8e4nv *fp32 *bf16 *fp32 *i32 *fp32 *i32")
        args += _ints("N K a_row_div stride_am stride_asm stride_we stride_wn stride_se stride_s1 stride_s2 "
                      "stride_om split_k")
        ce = dict(GATED=True, ROUTED=False, FP8_UPCAST=False, BLOCK_N=64, BLOCK_M=16, PDL=False)
        return Preset(mod._moe_pair_fp8_kernel, args, ce, ["N", "K", "stride_am", "stride_we", "stride_wn",
                                                           "stride_se", "stride_om"], ["stride_s2"], 4)
    if name in ("w4a16_gemv_sliced", "w4a16_gemv_kblock"):
        from dsquant.runtime.kernels.gemm import w4a16_gemv, w4a16_gemv_kblock
        args = _typed("x_ptr qw_ptr s_ptr z_ptr perm_ptr out_ptr part_ptr counters_ptr",
                      "*bf16 *i32 *bf16 *u8 *i32 *bf16 *fp32 *i32")
        args += _ints("M N num_chunks stride_xm stride_qn stride_sg stride_zg stride_om split_k")
        div = ["N", "num_chunks", "stride_xm", "stride_qn", "stride_sg", "stride_zg", "stride_om"]
        if name == "w4a16_gemv_sliced":
            ce = dict(GROUP=128, BLOCK_N=64, BLOCK_M=1, HAS_PERM=False, ASM=True, PDL=False)
            return Preset(w4a16_gemv._w4a16_gemv_sliced_kernel, args, ce, div, [], 2)
        ce = dict(GROUP=128, BLOCK_N=16, BLOCK_M=1, K_CHUNKS=16, HAS_PERM=False, ASM=True, PDL=False)
        return Preset(w4a16_gemv_kblock._w4a16_gemv_kblock_kernel, args, ce, div, [], 4)
    if name == "w4a16_mma":
        from dsquant.runtime.kernels.gemm import w4a16_mma
        args = _typed("x_ptr qw_ptr s_ptr z_ptr perm_ptr out_ptr part_ptr counters_ptr",
                      "*bf16 *i32 *bf16 *u8 *i32 *bf16 *fp32 *i32")
        args += _ints("M N num_chunks stride_xm stride_qn stride_sg stride_zg stride_om split_k")
        ce = dict(GROUP=128, BLOCK_N=64, BLOCK_M=16, HAS_PERM=False, MAGIC=0x4300, PAIRED=True, SWIZZLE=8, TILE_N=0,
                  PREFETCH=False, PDL=False)
        return Preset(w4a16_mma._w4a16_mma_kernel, args, ce,
                      ["N", "num_chunks", "stride_xm", "stride_qn", "stride_sg", "stride_zg", "stride_om"], [], 2)
    if name == "fp8_gemv":
        from dsquant.runtime.kernels.gemm import fp8_gemv as mod
        args = _typed("x_ptr xs_ptr w_ptr ws_ptr out_ptr part_ptr counters_ptr",
                      "*fp8e4nv *fp32 *fp8e4nv *fp32 *bf16 *fp32 *i32")
        args += _ints("M N K stride_xm stride_xsm stride_xsg stride_wn stride_wsn stride_om split_k")
        ce = dict(A_MODE=0, BLOCK_N=32, BLOCK_M=1, EVEN_K=True, PDL=False)
        return Preset(mod._fp8_gemv_kernel, args, ce, ["N", "K", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn",
                                                       "stride_om"], ["stride_xsg"], 4)
    if name == "fp8_gemv_kblock":
        from dsquant.runtime.kernels.gemm import fp8_gemv_kblock as mod
        args = _typed("xq_ptr xs_ptr w_ptr ws_ptr out_ptr part_ptr counters_ptr",
                      "*fp8e4nv *fp32 *fp8e4nv *fp32 *bf16 *fp32 *i32")
        args += _ints("M N K stride_xm stride_xsm stride_wn stride_wsn stride_om split_k")
        ce = dict(BLOCK_N=16, BLOCK_M=1, K_BLOCKS=4, FUSE_QUANT=False, PDL=False)
        return Preset(mod._fp8_gemv_kblock_kernel, args, ce, ["N", "K", "stride_xm", "stride_xsm", "stride_wn",
                                                              "stride_wsn", "stride_om"], [], 4)
    if name == "rms_norm":
        from dsquant.runtime.kernels.ops import rmsnorm as mod
        args = _typed("x_ptr res_ptr w_ptr out_ptr res_out_ptr", "*bf16 *bf16 *bf16 *bf16 *bf16")
        args += [("hidden", "i32"), ("eps", "fp32")] + _ints("stride_x stride_res stride_out stride_res_out")
        ce = dict(HAS_RESIDUAL=True, BLOCK=2048, PDL=False)
        return Preset(mod._rms_norm_kernel, args, ce, ["hidden", "stride_x", "stride_res", "stride_out",
                                                       "stride_res_out"], [], 8)
    if name == "router_logits":
        from dsquant.runtime.kernels.moe import router_gemv as mod
        args = _typed("x_ptr", "*bf16") + [("stride_xt", "i32")] + _typed("w_ptr out_ptr", "*bf16 *fp32")
        args += _ints("num_experts hidden")
        ce = dict(BLOCK_E=2, BLOCK_K=1024, PDL=False)
        return Preset(mod._router_logits_kernel, args, ce, ["stride_xt", "num_experts", "hidden"], [], 4)
    if name == "mla_prepare":
        from dsquant.runtime.kernels.attention import mla_absorb as mod
        args = [("q_ptr", "*bf16"), ("stride_qt", "i32"), ("stride_qh", "i32"), ("w_uk_ptr", "*bf16"),
                ("q_abs_ptr", "*bf16"), ("lat_ptr", "*bf16"), ("stride_lt", "i32"), ("norm_w_ptr", "*bf16"),
                ("eps", "fp32"), ("cos_ptr", "*fp32"), ("sin_ptr", "*fp32"), ("stride_cs", "i32"),
                ("cache_ptr", "*bf16"), ("slot_ptr", "*i64"), ("num_tokens", "i32"), ("num_heads", "i32")]
        ce = dict(NOPE=128, RANK=512, ROPE=64, BLOCK_T=16, BLOCK_R=128, INTERLEAVED=True, PDL=False)
        return Preset(mod._mla_prepare_kernel, args, ce, ["stride_qt", "stride_qh", "stride_lt", "stride_cs"], [], 4)
    if name == "mla_merge_uv":
        from dsquant.runtime.kernels.attention import mla_absorb as mod
        args = _typed("part_out_ptr part_lse_ptr w_uv_ptr out_ptr", "*fp32 *fp32 *bf16 *bf16")
        args += _ints("stride_ot stride_oh num_heads num_splits v_dim")
        ce = dict(RANK=512, BLOCK_S=16, CHUNK_S=8, BLOCK_R=512, BLOCK_V=32, PDL=False)
        return Preset(mod._mla_merge_uv_kernel, args, ce, ["stride_ot", "stride_oh", "v_dim"], [], 4)
    raise ValueError(f"unknown SASS preset {name!r}; see dsquant/bench/sass.py")


def compile_sm90(p: Preset, num_warps: int | None = None):
    """triton.compile of the preset for sm_90 (one stage, as the GEMVs launch)."""
    names = [a for a, _ in p.args]
    signature = dict(p.args) | {a: "constexpr" for a in [*p.ones, *p.constexprs]}
    constexprs = {**p.constexprs, **{a: 1 for a in p.ones}}
    # parameters the preset leaves out take their defaults, as a launch without them does (an optional
    # pointer defaults to None, which Triton specializes as a constexpr)
    for a, par in inspect.signature(p.kernel.fn).parameters.items():
        if a not in signature and par.default is not inspect.Parameter.empty:
            signature[a] = "constexpr"
            constexprs[a] = par.default
    ptrs = [a for a, t in p.args if t.startswith("*")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs + p.div16}
    return triton.compile(ASTSource(fn=p.kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps or p.num_warps, num_stages=1))


def tool_path(name: str) -> Path:
    """One of the NVIDIA tools Triton ships (ptxas, cuobjdump)."""
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def sass_of(kernel, workdir: Path, tag: str) -> tuple[str, str]:
    """(SASS text, register usage line) of a compiled kernel; its cubin is written under workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    cubin = workdir / f"{tag}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(tool_path("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([str(tool_path("cuobjdump")), "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    return sass, " ".join(re.findall(r"REG:\d+", res))


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) in program order."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def loops(sass: str):
    """(start, end, opcode Counter) of every backward branch's body of >= 60 instructions."""
    ins = instructions(sass)
    for addr, text in ins:
        tgt = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < addr:
            body = [t for a, t in ins if int(tgt.group(1), 16) <= a <= addr]
            if len(body) >= 60:
                ops = Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.(?:SHL|MOV|WIDE|U32|X|128|64|U16|U8))?)",
                                       t).group(1) for t in body)
                yield int(tgt.group(1), 16), addr, ops


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split(" ")[0]


def pdl_report(name: str, overrides: dict, workdir: Path) -> dict:
    """Where the PDL wait (ACQBULK) and release (PREEXIT) sit in the preset's SASS with PDL on:
    {"before_wait": opcodes before the first wait, "waits", "releases": their indices,
    "off_has_pdl": whether the PDL-off build still emits either instruction}."""
    p = preset(name)
    p.constexprs.update(overrides, PDL=True)
    ops = [_opcode(t) for _, t in instructions(sass_of(compile_sm90(p), workdir, name)[0])]
    waits = [i for i, t in enumerate(ops) if t == "ACQBULK"]
    p.constexprs["PDL"] = False
    plain = sass_of(compile_sm90(p), workdir, name + "_off")[0]
    return {"before_wait": ops[:waits[0]] if waits else ops, "waits": waits,
            "releases": [i for i, t in enumerate(ops) if t == "PREEXIT"],
            "off_has_pdl": "ACQBULK" in plain or "PREEXIT" in plain}


if __name__ == "__main__":  # python -m dsquant.bench.sass '[["preset", {overrides}], ...]' WORKDIR -> JSON list
    import json
    import sys

    cases = json.loads(sys.argv[1])
    print(json.dumps([pdl_report(n, o, Path(sys.argv[2])) for n, o in cases]))
