"""FP8 block GEMM at DeepSeek's shapes, every path, on weights whose block scales differ.

The bug this guards: cuBLASLt's 128 x 128 block scaling reads the weight scales row-major with
each row of K blocks padded to a multiple of 4; torch's `_scaled_mm` (2.11) accepted an
unpadded [N/128, K/128] matrix and passed it through, so for K/128 % 4 != 0 every block row
after the first read another row's scales. With one standard deviation everywhere all blocks
have about the same scale and that passed; with realistic weights (tests/realistic_weights.py)
it cannot.

Properties:
  - cublas_scale_layout keeps the values, gives a row pitch of round_up(K/128, 4) (or one row),
    and copies nothing when the layout is already so (CPU);
  - the Triton kernels (tiles, GEMV) read a padded scale view through its strides, as the
    runtime now passes it (CPU, interpreter);
  - on the GPU, at the linears of V2-Lite and V3 (K/128 % 4 = 0, 1, 2, 3), prefill (cuBLAS,
    or its Triton fallback), small batches (tiles) and decode (GEMV) equal the float W8A8
    product, per 128-channel block, and cuBLAS takes every shape with K/128 % 4 == 0.
"""
import pytest
import torch

from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_refused, fp8_block_linear
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8, per_token_group_quant_fp8_reference
from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig, fp8_config
from tests.kernels.fp8_cases import check_fp8_product, dequant_act, fp8_weights, poisoned


@pytest.mark.parametrize("nb,kb", [(1, 1), (1, 3), (2, 1), (4, 2), (3, 4), (5, 11), (7, 12)])
def test_cublas_scale_layout_pads_rows_to_four_blocks(nb, kb):
    """Same values, row pitch round_up(kb, 4) (any pitch for one row), unit column stride; a
    matrix already laid out so is returned as it is."""
    from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_scale_layout

    s = torch.rand(nb, kb) + 0.5
    out = cublas_scale_layout(s)
    assert torch.equal(out, s) and out.stride(1) == 1
    assert nb == 1 or out.stride(0) == -(-kb // 4) * 4
    assert cublas_scale_layout(out) is out


@pytest.mark.parametrize("m,cfg", [(3, GemmConfig(16, 64, 2, 4, 2)), (40, GemmConfig(64, 64, 1, 4, 2)),
                                   (2, GemmConfig(2, 32, 2, 4, 1, path="gemv")),
                                   (2, GemmConfig(2, 16, 2, 4, 1, path="gemv_kblock", k_chunks=2))])
def test_triton_paths_read_a_padded_scale_view(device, m, cfg):
    """The runtime hands the kernels cublas_scale_layout's strided view: tiles and GEMV give the
    same W8A8 product as with the contiguous scales."""
    n, k = 384, 640  # 3 x 5 blocks: pitch 8 != 5
    wq, ws, w_dense = fp8_weights(n, k, device, seed=m)
    padded = padded_scale(ws)
    assert padded.stride(0) == 8
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    xq, xs = per_token_group_quant_fp8_reference(x)
    y = fp8_block_linear(xq, wq, padded, x_scale=xs, out_dtype=torch.float16, config=cfg,
                         weight_only=False,  # else a device without FP8 MMA swaps the GEMV for the tiles
                         out=poisoned(m, n, torch.float16, device))
    check_fp8_product(y, dequant_act(xq, xs, k), w_dense, 2e-3)


# (N, K) of DeepSeek linears; K/128 % 4 in the comment
V2_LITE = [(3072, 2048), (576, 2048), (4096, 512), (2048, 2048), (2816, 2048), (2048, 1408),
           (2048, 2816), (128, 256), (256, 128), (512, 256),  # 0 0 0 0 0 3 2; tiny-v3: 2 1 2
           (10944, 2048), (5472, 2048)]  # the dense MLP's N (85.5 blocks of 128), a 96-channel last block
V3 = [(1536, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048), (2048, 7168)]  # 0 ...


def padded_scale(ws: torch.Tensor) -> torch.Tensor:
    """ws [nb, kb] as a view of a [nb, round_up(kb, 4)] buffer: the layout the runtime stores
    (built here independently of the code under test)."""
    nb, kb = ws.shape
    buf = torch.full((nb, -(-kb // 4) * 4), float("nan"), device=ws.device)  # the pad is never read
    buf[:, :kb] = ws
    return buf[:, :kb]


def _ref_device(xq, xs, w_dense, k):
    """Float32 operands on the GPU (no TF32): the reference product of large shapes."""
    a = xq.float() * xs.repeat_interleave(128, 1)[:, :k]  # [M, K]
    return a, w_dense.to(device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", V2_LITE + V3)
def test_fp8_kblock_gemv_at_deepseek_shapes_gpu(n, k):
    """The K-block GEMV (M <= 2) on x quantized in it or once before, uneven K split, against the
    W8A8 product.
    (Its masked step tails once read x past K, NaN at K = 128, 256, 1408, 2816 on the H200.)"""
    if k % 128:
        pytest.skip("the K-block GEMV takes whole 128-blocks of K")
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=n + k)
    runtime_scale = padded_scale(ws)
    for m in (1, 2):
        x = (torch.randn(m, k, device="cuda") * (1 + 9 * torch.rand(1, k, device="cuda"))).to(torch.bfloat16)
        xq, xs = per_token_group_quant_fp8(x)
        a, w32 = _ref_device(xq, xs, w_dense, k)
        for cfg in (GemmConfig(m, 16, 3, 4, 1, path="gemv_kblock", k_chunks=4),
                    GemmConfig(m, 128, 1, 8, 1, path="gemv_kblock", k_chunks=2)):
            for fuse in (True, False):  # x quantized inside the GEMV, or by per_token_group_quant_fp8 first
                y = fp8_block_linear(x, wq, runtime_scale, config=cfg, fuse_quant=fuse,
                                     out=poisoned(m, n, torch.bfloat16, "cuda"))
                check_fp8_product(y, a, w32, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", V2_LITE + V3)
def test_fp8_all_paths_at_deepseek_shapes_gpu(n, k):
    """Prefill M in {128, 200, 512}, small batches M in {16, 64} and decode M in {1, 2, 4}, through
    fp8_block_linear's default path and the forced cuBLAS path, against the W8A8 product."""
    assert not torch.backends.cuda.matmul.allow_tf32
    wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=n + k)
    runtime_scale = padded_scale(ws)  # the layout FP8BlockMethod stores
    for m in (1, 2, 4, 16, 64, 128, 200, 512):
        x = (torch.randn(m, k, device="cuda") * (1 + 9 * torch.rand(1, k, device="cuda"))).to(torch.bfloat16)
        xq, xs = per_token_group_quant_fp8(x)
        a, w32 = _ref_device(xq, xs, w_dense, k)
        for scale in (ws, runtime_scale):
            y = fp8_block_linear(x, wq, scale, out=poisoned(m, n, torch.bfloat16, "cuda"))
            check_fp8_product(y, a, w32, 1e-2)
        if m >= 128:
            forced = GemmConfig(128, 128, 1, 8, 3, path="cublas")
            y = fp8_block_linear(x, wq, runtime_scale, config=forced,
                                 out=poisoned(m, n, torch.bfloat16, "cuda"))
            check_fp8_product(y, a, w32, 1e-2)
    if torch.cuda.get_device_capability() == (9, 0) and n % 16 == 0 and (k // 128) % 4 == 0:
        assert fp8_config(512, n, k, "cuda").path == "cublas"
        assert not cublas_refused(n, k, torch.bfloat16, "cuda"), "cuBLAS refused a DeepSeek shape"


@pytest.mark.gpu
def test_cublas_records_which_shapes_it_took():
    """Prints, for the log, whether cuBLAS took each K/128 % 4 class (the rest ran the tiles)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise _scaled_mm runs on sm_90 only")
    taken = {}
    for n, k in [(256, 128), (512, 256), (512, 384), (512, 512), (2048, 1408), (2048, 2816),
                 (2048, 10944)]:  # the last: K/128 = 85.5 (cuBLAS path not chosen for it, only recorded)
        wq, ws, w_dense = fp8_weights(n, k, "cuda", seed=k)
        x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        y = fp8_block_linear(x, wq, padded_scale(ws), config=GemmConfig(128, 128, 1, 8, 3, path="cublas"))
        xq, xs = per_token_group_quant_fp8(x)
        check_fp8_product(y, *_ref_device(xq, xs, w_dense, k), 1e-2)
        taken[(n, k)] = not cublas_refused(n, k, torch.bfloat16, "cuda")
    print("cuBLAS took:", taken)
    assert taken[(512, 512)]
