"""FP8 block GEMV (M <= 4) and the cuBLAS prefill path of fp8_block_linear against float64 W8A8.

Properties: for M in {1, 2, 3, 4}, N and K multiples of 128 or not (partial edge blocks), with and
without split-K, the GEMV equals the float64 product of the dequantized fp8 activations and
weight it consumed; outputs are poisoned with NaN first and must be fully written; split-K
counters stay zero. fp8_config sends M <= 4 to the GEMV, never to it above, and never to cuBLAS
off sm_90. CPU runs fp16 with x quantized by torch (the interpreter mis-rounds in-kernel fp8
casts); the GPU runs the in-kernel quantizer in bf16 at full size, and the cuBLAS path (taken, and
refused by cuBLAS with the Triton fallback).
"""
import pytest
import torch

from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_refused, fp8_block_linear
from dsquant.runtime.kernels.gemm.fp8_quant import (per_token_group_quant_fp8,
                                               per_token_group_quant_fp8_reference)
from dsquant.runtime.kernels.gemm.gemm_configs import (FP8_CUBLAS_MIN_M, FP8_GEMV_MAX_WORK, FP8_GEMV_MAX_M, GemmConfig,
                                                  fp8_config, fp8_gemv_candidates)
from tests.kernels.fp8_cases import check_fp8_product, dequant_act, fp8_weights, poisoned


def _gemv_cfg(m, block_n, split, warps=4):
    return GemmConfig(1 << (m - 1).bit_length(), block_n, split, warps, 1, path="gemv")


SHAPES = [(200, 320), (256, 384)]  # (N, K): partial edge blocks, and whole blocks


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block_n,split", [(64, 1), (32, 2), (16, 3)])
def test_fp8_gemv_prequantized_matches_reference(device, m, n, k, block_n, split):
    wq, ws, w_dense = fp8_weights(n, k, device, seed=10 * m + split)
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    xq, xs = per_token_group_quant_fp8_reference(x)  # [M, K] e4m3, [M, ceil(K/128)]
    counters = torch.zeros(32, dtype=torch.int32, device=device)
    y = fp8_block_linear(xq, wq, ws, x_scale=xs, out_dtype=torch.float16, weight_only=False,
                         config=_gemv_cfg(m, block_n, split), splitk_counters=counters,
                         out=poisoned(m, n, torch.float16, device))
    check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)
    assert int(counters.abs().sum()) == 0, "split-K counters must be left zero"


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n", [200, 256])
@pytest.mark.parametrize("block_n,k_blocks,split", [(64, 1, 1), (32, 2, 2), (16, 4, 1), (128, 2, 1)])
def test_fp8_gemv_kblock_matches_reference(device, m, n, block_n, k_blocks, split):
    """The K-block FP8 GEMV on x quantized once: K = 384 (3 blocks; 2- and 4-block steps end masked),
    N = 200 (a partial row block), uneven split-K; the W8A8 product, poisoned output, counters zero.
    x and its scales sit in NaN-padded rows: the steps' masked tails must read none of it (the bug
    that gave NaN on the H200 at K = 128, 256, 1408, 2816)."""
    k = 384
    wq, ws, w_dense = fp8_weights(n, k, device, seed=7 * m + block_n)
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    xq, xs = nan_padded_rows(*per_token_group_quant_fp8_reference(x))
    counters = torch.zeros(32, dtype=torch.int32, device=device)
    cfg = GemmConfig(m, block_n, split, 4, 1, path="gemv_kblock", k_chunks=k_blocks)
    y = fp8_block_linear(xq, wq, ws, x_scale=xs, out_dtype=torch.float16, weight_only=False, config=cfg,
                         splitk_counters=counters, out=poisoned(m, n, torch.float16, device))
    check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)
    assert int(counters.abs().sum()) == 0, "split-K counters must be left zero"


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("block_n,k_blocks,split", [(32, 2, 2), (16, 4, 1)])
def test_fp8_gemv_kblock_fused_quant_runs_masked(device, m, block_n, k_blocks, split):
    """FUSE_QUANT (x_scale None: bf16/fp16 x quantized in the kernel) at K = 384, N = 200, x in
    NaN-padded rows: every output written, no NaN from past K, the W8A8 product of x as the Triton
    quantizer (per_token_group_quant_fp8, the same quant_group_fp8) rounds it; on CPU the interpreter
    mis-rounds in-kernel fp8 casts, but both kernels share that rounding."""
    from dsquant.runtime.kernels.gemm.fp8_gemv_kblock import fp8_gemv_kblock

    n, k = 200, 384
    wq, ws, w_dense = fp8_weights(n, k, device, seed=3 * m + block_n)
    buf = torch.full((m, k + 512), float("nan"), dtype=torch.float16, device=device)
    buf[:, :k] = torch.randn(m, k, dtype=torch.float16, device=device)
    x = buf[:, :k]
    xq, xs = per_token_group_quant_fp8(x)
    counters = torch.zeros(32, dtype=torch.int32, device=device)
    y = fp8_gemv_kblock(x, None, wq, ws, poisoned(m, n, torch.float16, device), block_n, k_blocks, split, 4,
                        splitk_counters=counters)
    check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)
    assert int(counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="bf16/fp16 activation"):
        fp8_gemv_kblock(xq, None, wq, ws, y, block_n, k_blocks, split, 4)


def nan_padded_rows(xq: torch.Tensor, xs: torch.Tensor):
    """xq [M, K] e4m3 and xs [M, K/128] as views of row buffers 512 columns (4 scales) wider,
    the pad NaN: a kernel that reads past K (a masked step's tail) turns its output NaN."""
    m, k = xq.shape
    qbuf = torch.full((m, k + 512), float("nan"), device=xq.device).to(torch.float8_e4m3fn)
    sbuf = torch.full((m, xs.shape[1] + 4), float("nan"), device=xs.device)
    qbuf[:, :k], sbuf[:, :xs.shape[1]] = xq, xs
    return qbuf[:, :k], sbuf[:, :xs.shape[1]]


def test_fp8_gemv_kblock_names_bad_inputs():
    from dsquant.runtime.kernels.gemm.fp8_gemv_kblock import fp8_gemv_kblock

    wq, ws, _ = fp8_weights(128, 256, "cpu", seed=1)
    xq, xs = per_token_group_quant_fp8_reference(torch.randn(3, 256))
    out = torch.empty(3, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 or 2 rows"):
        fp8_gemv_kblock(xq, xs, wq, ws, out, 32, 2, 1, 4)
    with pytest.raises(ValueError, match="block_n"):
        fp8_gemv_kblock(xq[:1], xs[:1], wq, ws, out[:1], 256, 2, 1, 4)


def test_fp8_gemv_is_the_default_path_for_small_m(device):
    n, k = 200, 320
    wq, ws, w_dense = fp8_weights(n, k, device, seed=5)
    for m in range(1, FP8_GEMV_MAX_M + 1):
        assert fp8_config(m, n, k, device).path == "gemv"
        x = torch.randn(m, k, dtype=torch.float16, device=device)
        xq, xs = per_token_group_quant_fp8_reference(x)
        y = fp8_block_linear(xq, wq, ws, x_scale=xs, out_dtype=torch.float16,
                             out=poisoned(m, n, torch.float16, device))
        check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)
    assert fp8_config(FP8_GEMV_MAX_M + 1, n, k, device).path != "gemv"


def test_fp8_config_paths_by_token_count():
    assert fp8_config(FP8_CUBLAS_MIN_M, 4096, 7168, "cpu").path != "cublas"  # no sm_90 here
    assert fp8_config(1, 4096, 7168, "cpu").path == "gemv"  # the K-block GEMV only where measured


@pytest.mark.parametrize("n,k,k_blocks,split", [(18432, 7168, 4, 1), (21888, 2048, 4, 1), (4096, 7168, 4, 2),
                                                (2048, 2048, 8, 1), (4096, 512, 4, 1)])
def test_fp8_config_sends_one_token_to_the_kblock_gemv_on_sm90(monkeypatch, n, k, k_blocks, split):
    """On sm_90 one token at whole 128-blocks of K takes the K-block GEMV (at any work size: it beat
    cuBLAS at 18432 x 7168); a partial K block, or two tokens, keep the per-block GEMV."""
    import dsquant.runtime.kernels.gemm.gemm_configs as gc

    monkeypatch.setattr(gc, "_gpu_family", lambda device=None: "sm90")
    cfg = fp8_config(1, n, k)
    assert (cfg.path, cfg.block_m, cfg.block_n, cfg.k_chunks, cfg.split_k) == ("gemv_kblock", 1, 16, k_blocks, split)
    assert fp8_config(1, 200, 320).path == "gemv" and fp8_config(2, 2048, 2048).path == "gemv"


def test_kblock_fuses_quant_only_for_one_token_on_small_weights():
    from dsquant.runtime.kernels.gemm.gemm_configs import kblock_fuses_quant

    assert kblock_fuses_quant(1, 3648, 2048) and kblock_fuses_quant(1, 4096, 512)
    assert not kblock_fuses_quant(1, 21888, 2048) and not kblock_fuses_quant(1, 4096, 7168)
    assert not kblock_fuses_quant(2, 2048, 2048)
    assert {c.path for c in fp8_gemv_candidates(3)} == {"gemv"}
    assert {c.block_m for c in fp8_gemv_candidates(3)} == {4}


def test_fp8_gemv_weight_only_keeps_x_unquantized(device):
    m, n, k = 2, 136, 392
    wq, ws, w_dense = fp8_weights(n, k, device, seed=7)
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    y = fp8_block_linear(x, wq, ws, weight_only=True, config=_gemv_cfg(m, 64, 2),
                         out=poisoned(m, n, torch.float16, device))
    check_fp8_product(y, x.cpu().to(torch.float64), w_dense, 2e-3)  # exact x: the tiled weight-only path


def test_fp8_gemv_rejects_too_many_tokens(device):
    wq, ws, _ = fp8_weights(200, 320, device, seed=8)
    x = torch.randn(FP8_GEMV_MAX_M + 1, 320, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="'gemv' serves M <= 4"):
        fp8_block_linear(x, wq, ws, weight_only=False, config=_gemv_cfg(4, 64, 1))


def test_fp8_quant_pads_rows_with_zeros(device):
    x = torch.randn(5, 300, dtype=torch.float16, device=device) * 3
    xq, xs = per_token_group_quant_fp8(x, column_major_scales=True, rows_multiple=16)
    assert xq.shape == (16, 300) and xs.shape == (16, 3) and xs.stride() == (1, 16)
    assert (xq[5:].view(torch.uint8) == 0).all() and (xs[5:] == 0).all()
    _, xs_ref = per_token_group_quant_fp8_reference(x)
    assert torch.allclose(xs[:5].cpu(), xs_ref.cpu(), rtol=2e-7, atol=0)


def test_fp8_cublas_refusal_falls_back_to_triton_prequantized(device):
    """cuBLAS refuses N % 16 != 0 (and runs nothing on CPU): the Triton kernel answers, and the
    refusal is remembered for the shape."""
    m, n, k = 32, 200, 256
    wq, ws, w_dense = fp8_weights(n, k, device, seed=9)
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    xq, xs = per_token_group_quant_fp8_reference(x)
    forced = GemmConfig(32, 64, 1, 4, 2, path="cublas")
    for _ in range(2):
        y = fp8_block_linear(xq, wq, ws, x_scale=xs, out_dtype=torch.float16, config=forced,
                             weight_only=False, out=poisoned(m, n, torch.float16, device))
        check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)
    assert cublas_refused(n, k, torch.float16, device)


# ---------------------------------------------------------------- GPU, full size, bf16
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n", [(7168, 18432), (2048, 2816), (7100, 4040)])
def test_fp8_gemv_gpu_in_kernel_quant_bf16(m, k, n):
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    xq, xs = per_token_group_quant_fp8(x)  # the same quant_group_fp8 arithmetic as the GEMV
    a_dense = dequant_act(xq, xs, k)
    kblock = m == 1 and k % 128 == 0 and torch.cuda.get_device_capability()[0] == 9
    small = m * n * k <= FP8_GEMV_MAX_WORK or (m <= 2 and (n % 16 != 0 or k % 128 != 0))
    path = fp8_config(m, n, k, "cuda").path
    if kblock or small:
        assert path == ("gemv_kblock" if kblock else "gemv")
    else:
        assert path in ("cublas", "fused", "weight_only")  # cuBLAS or the tiles
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    for cfg in (None, _gemv_cfg(m, 64, 1), _gemv_cfg(m, 32, 8), _gemv_cfg(m, 128, 4, warps=8)):
        y = fp8_block_linear(x, wq, ws, config=cfg, splitk_counters=counters,
                             out=poisoned(m, n, torch.bfloat16, "cuda"))
        check_fp8_product(y, a_dense, w_dense, 1e-2)
        assert int(counters.abs().sum()) == 0
    y0 = fp8_block_linear(xq, wq, ws, x_scale=xs, out=poisoned(m, n, torch.bfloat16, "cuda"))
    check_fp8_product(y0, a_dense, w_dense, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 16, 128, 300, 1024])
def test_fp8_cublas_path_matches_reference(m):
    k, n = 7168, 4096 if m >= 128 else 18432  # decode sizes above one token take cuBLAS on the large weight
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise _scaled_mm runs on sm_90 only")
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    assert fp8_config(m, n, k, "cuda").path == "cublas"
    xq, xs = per_token_group_quant_fp8(x)
    y = fp8_block_linear(x, wq, ws, out=poisoned(m, n, torch.bfloat16, "cuda"))
    check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 1e-2)
    assert not cublas_refused(n, k, torch.bfloat16, "cuda"), "cuBLAS refused a DeepSeek shape"
    y_new = fp8_block_linear(x, wq, ws)  # no out: cuBLAS's own buffer, first M rows
    assert y_new.shape == (m, n) and y_new.is_contiguous()
    check_fp8_product(y_new, dequant_act(xq, xs, k), w_dense, 1e-2)


@pytest.mark.gpu
def test_fp8_cublas_refusal_falls_back_to_triton():
    m, n, k = 256, 200, 512  # N % 16 != 0: _scaled_mm refuses it
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=3)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    xq, xs = per_token_group_quant_fp8(x)
    forced = GemmConfig(128, 128, 1, 8, 3, path="cublas")
    for _ in range(2):  # the second call skips cuBLAS (remembered), same result
        y = fp8_block_linear(x, wq, ws, config=forced, out=poisoned(m, n, torch.bfloat16, "cuda"))
        check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 1e-2)
    assert cublas_refused(n, k, torch.bfloat16, "cuda")
