"""`dsquant bench gemm`: W4A16 and FP8 block GEMMs beside cuBLAS bf16, tinygemm and _scaled_mm.

For each weight shape K x N and token count M, on one random bf16 weight and one random x, times:
  bf16        torch.matmul on the bf16 weight (cuBLAS)
  tinygemm    torch.ops.aten._weight_int4pack_mm on the same int4 codes, packed by
              torch.ops.aten._convert_weight_to_int4pack (group 128, bf16 scales and zeros)
  scaled_mm   torch._scaled_mm, blockwise scales (x 1x128, W 128x128), on x already quantized
              (the quantizer is not in its time); "refused" where cuBLAS rejects the shape
  w4a16       dsquant w4a16_linear (AWQ codes repacked), the path gemm_configs picks for M
  fp8         dsquant fp8_block_linear from bf16 x, activation quantization included, on the path
              it picks for M (gemm_configs.fp8_config: GEMV for M <= 4, cuBLAS blockwise
              _scaled_mm for prefill on sm_90, else the Triton tiles); the row's note names it
  fp8_triton  the Triton tiled FP8 kernel alone (path forced to "fused"), for comparison
Times are medians as CUDA-graph replays and as eager launches (common.time_graph_and_eager);
TFLOP/s and weight GB/s use the graph time; speed-ups are over bf16 in the same run. Each
method's output is checked against an fp32 product with its own dequantized weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import click

from dsquant.bench.common import environment, time_graph_and_eager, write_json

SHAPES = "2048x10944,2048x2816,7168x4096,7168x18432"
M_VALUES = "1,4,16,64,256,1024,4096"
METHODS = ("bf16", "tinygemm", "scaled_mm", "w4a16", "fp8", "fp8_triton")


@dataclass
class GemmRow:
    k: int
    n: int
    m: int
    method: str
    graph_us: float | None
    eager_us: float | None
    tflops: float | None
    weight_gbps: float | None
    speedup_graph: float | None  # bf16 graph time / this graph time
    speedup_eager: float | None
    rel_err: float | None  # vs fp32 x @ (this method's dequantized weight)^T
    note: str = ""


def _tinygemm_pack(q, scales, zeros, group):
    """Codes [N, K], scales/zeros [N, K/G] -> tinygemm's packed weight and [K/G, N, 2] bf16 qparams.

    tinygemm dequantizes w = (q - 8) * scale + zero, so zero = (8 - z) * scale for w = (q - z) * s.
    """
    import torch

    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    zero = (8 - zeros.to(torch.float32)) * scales
    qparams = torch.stack([scales, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, qparams


def _weights(k, n, group, seed):
    import torch

    from dsquant.formats.awq_gemm import to_awq_tensors
    from dsquant.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
    from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise
    from dsquant.runtime.kernels.gemm.w4a16_repack import repack_awq

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # [N, K]
    q, s, z = quantize_int_groupwise(w, group)
    qweight, qzeros, scales = to_awq_tensors(q, s, z, dtype=torch.bfloat16)
    int4 = repack_awq(qweight, qzeros, scales, group)
    w_int4 = dequantize_int_groupwise(q, scales.t().float(), z, group)  # [N, K] what int4 sees
    try:
        tg = _tinygemm_pack(q, scales.t().float(), z, group)
    except RuntimeError as e:  # recorded as "refused" for each M
        tg = (e, None)
    wq, ws = quantize_fp8_block(w)
    w_fp8 = dequantize_fp8_block(wq, ws)
    return dict(w=w, int4=int4, w_int4=w_int4, tg=tg, fp8=(wq, ws), w_fp8=w_fp8)


def load_configs(path):
    """Sweep output (scripts/gemm_sweep.py JSON) -> {(kind, m_bucket, n, k): GemmConfig}."""
    import json

    from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig

    with open(path) as f:
        best = json.load(f)["best"]
    return {tuple(b["key"]): GemmConfig(**b["cfg"]) for b in best}


def _fp8_configs(m, n, k, cfg_file, device):
    """(config of the default fp8 path, config of the forced Triton tiles); sweep-file configs are
    Triton tile configs, so they only replace a tiled choice."""
    from dataclasses import replace

    from dsquant.runtime.kernels.gemm.gemm_configs import fp8_config, fp8_tiled_config

    default = fp8_config(m, n, k, device)
    tiled = cfg_file or fp8_tiled_config(m, n, k, device)
    if tiled.path in ("gemv", "cublas"):
        tiled = replace(tiled, path="fused")
    return (default if default.path in ("gemv", "cublas") else tiled), tiled


def _methods(wts, x, group, configs=None):
    """name -> (fn, weight bytes, dense fp32 weight the method computes with, note)."""
    import torch

    from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear
    from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8
    from dsquant.runtime.kernels.gemm.w4a16_gemm import w4a16_linear

    from dsquant.runtime.kernels.gemm.gemm_configs import m_bucket

    w, int4, (tg_packed, tg_qparams), (wq, ws) = wts["w"], wts["int4"], wts["tg"], wts["fp8"]
    m, k = x.shape
    n = w.shape[0]
    cfg_w4 = (configs or {}).get(("w4a16", m_bucket(m), n, k))  # None: gemm_configs' own choice
    cfg_f8, cfg_f8_tiled = _fp8_configs(m, n, k, (configs or {}).get(("fp8", m_bucket(m), n, k)),
                                        x.device)
    xq, xs = per_token_group_quant_fp8(x, column_major_scales=True)
    counters = torch.zeros(8192, dtype=torch.int32, device="cuda")
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    def tinygemm():
        if isinstance(tg_packed, Exception):
            raise RuntimeError(f"packing failed: {tg_packed}")
        return torch.ops.aten._weight_int4pack_mm(x, tg_packed, group, tg_qparams)
    return {
        "bf16": (lambda: torch.matmul(x, w.t()), nbytes(w), w.float(), ""),
        "tinygemm": (tinygemm, nbytes(tg_packed, tg_qparams), wts["w_int4"], ""),
        "scaled_mm": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(),
                                               out_dtype=torch.bfloat16),
                      nbytes(wq, ws), wts["w_fp8"], ""),
        "w4a16": (lambda: w4a16_linear(x, int4, cfg_w4), int4.nbytes(), wts["w_int4"], ""),
        "fp8": (lambda: fp8_block_linear(x, wq, ws, config=cfg_f8, splitk_counters=counters),
                nbytes(wq, ws), wts["w_fp8"], f"path {cfg_f8.path}"),
        "fp8_triton": (lambda: fp8_block_linear(x, wq, ws, config=cfg_f8_tiled, splitk_counters=counters),
                       nbytes(wq, ws), wts["w_fp8"], f"path {cfg_f8_tiled.path}"),
    }


def run_shape(k, n, m_values, group, rep_ms, seed=0, configs=None) -> list[GemmRow]:
    import torch

    from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_refused

    wts = _weights(k, n, group, seed)
    rows = []
    for m in m_values:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = {}
        for name, (fn, wbytes, dense, note) in _methods(wts, x, group, configs).items():
            try:
                y = fn()
            except RuntimeError as e:  # cuBLAS's blockwise path refuses some shapes
                rows.append(GemmRow(k, n, m, name, None, None, None, None, None, None, None,
                                    f"refused: {str(e).splitlines()[0][:120]}"))
                continue
            ref = x.float() @ dense.t()
            rel = ((y.float() - ref).norm() / ref.norm()).item()
            g_us, e_us = time_graph_and_eager(fn, warmup_ms=10, rep_ms=rep_ms)
            if name == "bf16":
                base = {"g": g_us, "e": e_us}
            if note == "path cublas" and cublas_refused(n, k, torch.bfloat16, x.device):
                note = "path cublas, refused by cuBLAS: Triton tiles ran"
            rows.append(GemmRow(k, n, m, name, g_us, e_us, 2 * m * n * k / g_us / 1e6,
                                wbytes / g_us / 1e3, base["g"] / g_us, base["e"] / e_us, rel, note))
        del x
    del wts
    torch.cuda.empty_cache()
    return rows


def _time(rows, k, n, m, method, key="graph_us"):
    for r in rows:
        if (r.k, r.n, r.m, r.method) == (k, n, m, method):
            return getattr(r, key)
    return None


def check_targets(rows) -> list[tuple[str, str, bool]]:
    """Issue 9's targets (graph times) -> [(target, measured, met)]."""
    out = []

    def ratio(k, n, m, a, b):  # time(b) / time(a): how many times faster a is than b
        ta, tb = _time(rows, k, n, m, a), _time(rows, k, n, m, b)
        return None if ta is None or tb is None else tb / ta

    def path(k, n, m):  # which fp8 path ran, for the target's name
        note = next((r.note for r in rows if (r.k, r.n, r.m, r.method) == (k, n, m, "fp8")), "")
        return f" [{note}]" if note else ""

    def add(name, val, ok):
        out.append((name, "n/a" if val is None else f"{val:.2f}", bool(val is not None and ok(val))))

    for k, n in ((7168, 18432), (7168, 4096)):
        for m in (1, 4, 16):
            add(f"w4a16 vs bf16 {k}x{n} M={m} >= 2.5x", ratio(k, n, m, "w4a16", "bf16"), lambda v: v >= 2.5)
            add(f"w4a16 vs tinygemm {k}x{n} M={m} >= 1.5x", ratio(k, n, m, "w4a16", "tinygemm"),
                lambda v: v >= 1.5)
        add(f"w4a16 vs bf16 {k}x{n} M=64 >= 1.5x", ratio(k, n, 64, "w4a16", "bf16"), lambda v: v >= 1.5)
        for m in (1, 4, 16, 64):
            add(f"fp8 vs bf16 {k}x{n} M={m} >= 1.6x{path(k, n, m)}", ratio(k, n, m, "fp8", "bf16"),
                lambda v: v >= 1.6)
    for k, n in ((2048, 10944), (2048, 2816)):
        for m in (1, 4, 16):
            add(f"w4a16 vs tinygemm {k}x{n} M={m} >= 1.0x", ratio(k, n, m, "w4a16", "tinygemm"),
                lambda v: v >= 1.0)
    shapes = sorted({(r.k, r.n) for r in rows})
    for k, n in shapes:
        for m in (1024, 4096):
            add(f"w4a16 time / bf16 time {k}x{n} M={m} <= 1.25", None if ratio(k, n, m, "w4a16", "bf16") is None
                else 1 / ratio(k, n, m, "w4a16", "bf16"), lambda v: v <= 1.25)
            add(f"fp8 vs scaled_mm {k}x{n} M={m} >= 0.9x{path(k, n, m)}", ratio(k, n, m, "fp8", "scaled_mm"),
                lambda v: v >= 0.9)
    add("w4a16 7168x18432 M=1 <= 22 us", _time(rows, 7168, 18432, 1, "w4a16"), lambda v: v <= 22)
    add("fp8 M=1 runs (7168x18432, us)", _time(rows, 7168, 18432, 1, "fp8"), lambda v: v > 0)
    add("fp8 7168x18432 M=1 <= 44 us" + path(7168, 18432, 1), _time(rows, 7168, 18432, 1, "fp8"),
        lambda v: v <= 44)
    return out


def markdown_table(rows) -> str:
    """Cells: graph us / eager us (graph speed-up over bf16)."""
    lines = ["| K x N | M | " + " | ".join(METHODS) + " |", "| --- | --- |" + " --- |" * len(METHODS)]
    for k, n, m in sorted({(r.k, r.n, r.m) for r in rows}, key=lambda t: (t[0], t[1], t[2])):
        cells = []
        for meth in METHODS:
            g, e = _time(rows, k, n, m, meth), _time(rows, k, n, m, meth, "eager_us")
            s = _time(rows, k, n, m, meth, "speedup_graph")
            cells.append("refused" if g is None else f"{g:.1f} / {e:.1f} ({s:.2f}x)")
        lines.append(f"| {k} x {n} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rates_table(rows, ms=(1, 16, 4096)) -> str:
    """Achieved weight GB/s and TFLOP/s (graph times) per method."""
    lines = ["| K x N | M | " + " | ".join(f"{m} GB/s, TFLOP/s" for m in METHODS) + " |",
             "| --- | --- |" + " --- |" * len(METHODS)]
    for k, n, m in sorted({(r.k, r.n, r.m) for r in rows if r.m in ms}):
        cells = []
        for meth in METHODS:
            gb, tf = _time(rows, k, n, m, meth, "weight_gbps"), _time(rows, k, n, m, meth, "tflops")
            cells.append("-" if gb is None else f"{gb:.0f}, {tf:.1f}")
        lines.append(f"| {k} x {n} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command(name="gemm", short_help="W4A16 and FP8 block GEMMs vs cuBLAS and peers (GPU).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--shapes", default=SHAPES, show_default=True, help="Comma-separated KxN weights.")
@click.option("--m", "m_list", default=M_VALUES, show_default=True, help="Comma-separated token counts.")
@click.option("--group-size", default=128, show_default=True, type=click.Choice(["32", "64", "128"]),
              help="INT4 quantization group size.")
@click.option("--rep-ms", default=50, show_default=True, help="Timing window per measurement.")
@click.option("--configs", "configs_path", type=click.Path(exists=True, dir_okay=False),
              help="Use these configs (scripts/gemm_sweep.py output) instead of gemm_configs' table.")
def gemm(json_path, shapes, m_list, group_size, rep_ms, configs_path) -> None:
    """W4A16 and FP8 block GEMM vs cuBLAS bf16, tinygemm int4 and blockwise _scaled_mm (GPU)."""
    import torch

    from dsquant.errors import DsquantError

    if not torch.cuda.is_available():
        raise DsquantError("dsquant bench gemm needs a CUDA GPU")
    try:
        dims = [tuple(int(v) for v in s.lower().split("x")) for s in shapes.split(",")]
        ms = [int(v) for v in m_list.split(",")]
    except ValueError:
        raise DsquantError(f"--shapes must look like 7168x4096,2048x2816 and --m like 1,16; got "
                           f"{shapes!r} and {m_list!r}") from None
    configs = load_configs(configs_path) if configs_path else None
    rows = []
    for k, n in dims:
        rows += run_shape(k, n, ms, int(group_size), rep_ms, configs=configs)
        for r in rows[-len(ms) * len(METHODS):]:
            g = "refused" if r.graph_us is None else f"{r.graph_us:9.1f} us  x{r.speedup_graph:5.2f}"
            click.echo(f"{k:5d}x{n:<6d} M={r.m:<5d} {r.method:10s} {g}  err {r.rel_err}  {r.note}")
    env = environment()
    click.echo(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  {env['date']}\n")
    click.echo(markdown_table(rows) + "\n\n" + rates_table(rows))
    targets = check_targets(rows)
    click.echo("\ntargets:")
    for name, val, ok in targets:
        click.echo(f"  [{'met' if ok else 'MISS'}] {name}: {val}")
    write_json(json_path, rows, {"group_size": int(group_size), "targets": targets})
