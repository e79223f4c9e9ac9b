"""Which weight-scale layout torch._scaled_mm's blockwise 128x128 mode reads right (H200).

For (N, K) with K/128 % 4 = 0..3 and weights whose block scales differ (tests/realistic_weights.py),
runs the cuBLASLt blockwise GEMM with the weight scales passed (a) contiguous [N/128, K/128] (what
dsquant passed up to 57581c7) and (b) row-padded to a pitch of round_up(K/128, 4)
(fp8_gemm.cublas_scale_layout), against the float32 W8A8 product. Prints a table, writes JSON.
Usage: python scripts/fp8_cublas_probe.py OUT.json
"""
import json
import sys

import torch

sys.path.insert(0, ".")
from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_scale_layout  # noqa: E402
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8  # noqa: E402
from tests.kernels.fp8_cases import fp8_weights  # noqa: E402
from tests.realistic_weights import max_block_rel_err  # noqa: E402

SHAPES = [(256, 128), (512, 256), (512, 384), (512, 512), (2048, 1408), (2048, 2816), (3072, 2048),
          (24576, 1536), (7168, 2048)]


def run(n, k, layout, m=256):
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = per_token_group_quant_fp8(x, column_major_scales=True)  # [M, K], [M, K/128] col-major
    ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ w_dense.cuda().float().t()
    scale = ws.contiguous() if layout == "contiguous" else cublas_scale_layout(ws)
    try:
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as e:
        return {"refused": str(e).splitlines()[0][:120]}
    rel = float((y.float() - ref).norm() / ref.norm())
    return {"rel_err": rel, "worst_block_rel_err": max_block_rel_err(y, ref)}


def main(path):
    rows = []
    for n, k in SHAPES:
        for layout in ("contiguous", "padded"):
            r = {"n": n, "k": k, "kb_mod4": (k // 128) % 4, "layout": layout, **run(n, k, layout)}
            rows.append(r)
            print(f"N {n:6d} K {k:5d} kb%4 {r['kb_mod4']} {layout:10s} "
                  + (f"rel {r['rel_err']:.2e} worst block {r['worst_block_rel_err']:.2e}" if "rel_err" in r
                     else f"refused: {r['refused']}"))
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
