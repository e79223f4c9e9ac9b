"""W4A16 dequant-GEMM against a float64 reference built from the quantizer's codes and scales.

Properties: the AWQ/GPTQ repacks dequantize to exactly the checkpoint's weight; the kernel, on
every path (GEMV, split-K decode, tiled prefill, dequantize + cuBLAS), matches x @ W^T on fresh
inputs for M in {1, 3, 17, 64, 300}, every group size, N and K that are not multiples of the
tiles, and GPTQ act-order, over the whole output and over every block of 128 output channels;
the poisoned (NaN) output is fully overwritten; split-K counters are left at zero. Weights come
from tests/realistic_weights.py with one random factor per 16 rows x one group, so group scales
spread over three orders of magnitude along N and K (a transposed or mis-strided scale or zero
matrix fails), with outlier input channels, zero rows and a zero group tile; activations have
outlier channels. CPU: fp16 under TRITON_INTERPRET=1; GPU: DeepSeek V2-Lite / V3 dense and
attention shapes in bf16.
"""
import pytest
import torch

from dsquant.formats.awq_gemm import pack_awq, to_awq_tensors
from dsquant.formats.gptq import pack_gptq_qweight, pack_gptq_qzeros
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig
from dsquant.runtime.kernels.gemm.w4a16_gemm import w4a16_dequantize, w4a16_linear
from dsquant.runtime.kernels.gemm.w4a16_repack import (dequantize_w4a16, repack_awq, repack_gptq,
                                                  w4a16_linear_reference)
from tests.realistic_weights import max_block_rel_err, realistic_activations, realistic_weight

M_VALUES = [1, 3, 17, 64, 300]
TILE_ROWS = 16  # output rows per random factor: group scales vary along N as well as K


def _weight(n, k, group, device, seed):
    """float32 [N, K] on `device`: realistic_weight with a (16, group) tile (drawn on the GPU there)."""
    on_gpu = torch.device(device).type == "cuda"
    return realistic_weight(n, k, seed=seed, tile=(TILE_ROWS, group), device=device,
                            draw_device=device if on_gpu else None)


def _codes_dense(q, scales, zeros, group):
    """float64 [N, K] = (q - z) * s from codes q [N, K] and the stored scales / zeros [N, K/G]."""
    z = zeros.double().repeat_interleave(group, -1)
    return (q.double() - z) * scales.double().repeat_interleave(group, -1)


def _awq_weights(n, k, group, device, seed):
    """(W4A16Weights repacked from AutoAWQ tensors, float64 dense [N, K] on `device`)."""
    q, s, z = quantize_int_groupwise(_weight(n, k, group, device, seed), group)  # [N, K], [N, K/G] x 2
    qweight, qzeros, scales = to_awq_tensors(q, s, z, dtype=torch.float16)  # scales [K/G, N] fp16
    return repack_awq(qweight, qzeros, scales, group), _codes_dense(q, scales.t(), z, group)


def _act_order_gptq(n, k, group, device, seed):
    """GPTQ v1 tensors with a random act-order g_idx, repacked, and their float64 dense weight.
    The realistic tiles lie along the quantization order, so each act-order group keeps its own
    scale (drawn in the order the channels are quantized, scattered to the stored order)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(k, generator=gen).to(device)  # channel order[j] is quantized j-th
    g_idx = torch.empty(k, dtype=torch.int32, device=device)
    g_idx[order] = (torch.arange(k, device=device) // group).to(torch.int32)
    q, s, z = quantize_int_groupwise(_weight(n, k, group, device, seed), group)  # quantization order
    z = z.clamp(1, 15)  # GPTQ v1 stores z - 1: 0 does not survive
    scales = s.t().contiguous().to(torch.float16)  # [K/G, N]
    q_stored = torch.empty_like(q)
    q_stored[:, order] = q
    dense = torch.empty(n, k, dtype=torch.float64, device=device)
    dense[:, order] = _codes_dense(q, scales.t(), z, group)
    packed = repack_gptq(pack_gptq_qweight(q_stored.t()), pack_gptq_qzeros(z.t()), scales, g_idx)
    return packed, dense


def _check(y, x, dense, dtype, what=""):
    """y [M, N] against x @ dense^T in float64 on dense's device: whole output and every block of
    128 output channels (an error in a block of small group scales is not hidden)."""
    ref = x.to(dense.device).double() @ dense.t()  # [M, N]
    assert torch.isfinite(y).all(), f"{what}: output has NaN/Inf: some element was not written"
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    err = float((y.to(ref.device).double() - ref).norm() / ref.norm())
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"
    worst = max_block_rel_err(y, ref)
    assert worst < 2 * tol, f"{what}: worst 128-channel block relative error {worst:.2e} >= {2 * tol:.0e}"


def _poisoned(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _x(m, k, dtype, device, seed):
    """Activations [M, K]: N(0, 1) with outlier channels x 20."""
    return realistic_activations(m, k, seed=seed, device=device, dtype=dtype)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_repack_awq_dequantizes_to_checkpoint_weight(group):
    """repack_awq's layout dequantizes (pure torch) to exactly the AWQ tensors' weight."""
    packed, dense = _awq_weights(72, 4 * group, group, "cpu", seed=group)
    assert torch.equal(dequantize_w4a16(packed, torch.float64), dense)


def test_repack_gptq_act_order_matches_g_idx_dequant():
    """repack_gptq with an act-order g_idx: a permutation of K, and the torch path equals the
    dense weight in the stored channel order."""
    packed, dense = _act_order_gptq(40, 256, 64, "cpu", seed=5)
    assert packed.perm is not None and sorted(packed.perm.tolist()) == list(range(256))
    x = torch.randn(5, 256, dtype=torch.float64)
    y = w4a16_linear_reference(x, packed, torch.float64)
    assert torch.allclose(y, x @ dense.t(), rtol=1e-10, atol=1e-10)


def test_repack_rejects_mismatched_scales():
    qweight = pack_awq(torch.zeros(256, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales has shape"):
        repack_awq(qweight, torch.zeros(4, 8, dtype=torch.int32), torch.ones(3, 64), 64)


def _decode_cfg(m, split):
    return GemmConfig(max(16, 1 << (m - 1).bit_length()), 64, split, 4, 2)


CPU_CASES = [  # (M, group, config or None for the heuristic)
    *[(m, g, None) for m in M_VALUES for g in (32, 64, 128)],
    (1, 32, _decode_cfg(1, 3)), (3, 64, _decode_cfg(3, 4)), (17, 128, _decode_cfg(17, 2)),
    (64, 32, _decode_cfg(64, 4)), (300, 64, GemmConfig(64, 64, 1, 4, 2)),
    (17, 64, GemmConfig(128, 128, 1, 8, 2, path="dequant")),
    # GEMV (M <= 4): uneven splits, narrow and wide channel blocks, padded token block
    (1, 64, GemmConfig(1, 32, 3, 4, 1, path="gemv")), (2, 32, GemmConfig(2, 128, 1, 4, 1, path="gemv")),
    (3, 128, GemmConfig(4, 64, 2, 2, 1, path="gemv")), (4, 64, GemmConfig(4, 16, 4, 1, 1, path="gemv")),
]


@pytest.mark.parametrize("m,group,cfg", CPU_CASES)
def test_w4a16_awq_matches_reference(device, m, group, cfg):
    """Every path and config equals x @ W^T (whole output and per 128-channel block) into a
    poisoned output; N = 200 and K = 5 groups are multiples of no tile (nor of 128 for groups 32
    and 64) and split unevenly over split-K; the counters are left zero."""
    n, k = 200, 5 * group
    packed, dense = _awq_weights(n, k, group, device, seed=m * 1000 + group)
    x = _x(m, k, torch.float16, device, seed=m)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, n, torch.float16, device))
    _check(y, x, dense, torch.float16)
    assert int(packed.splitk_counters.abs().sum()) == 0


@pytest.mark.parametrize("m,cfg", [(3, _decode_cfg(3, 2)), (300, None), (2, GemmConfig(2, 64, 3, 4, 1, path="gemv")),
                                   (17, GemmConfig(32, 64, 1, 4, 2, path="dequant"))])
def test_w4a16_gptq_act_order_matches_reference(device, m, cfg):
    """GPTQ act-order (the kernel gathers x[:, perm]) on every path equals x @ W^T; N = 136, K = 320."""
    packed, dense = _act_order_gptq(136, 320, 64, device, seed=m)
    x = _x(m, 320, torch.float16, device, seed=m)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, 136, torch.float16, device))
    _check(y, x, dense, torch.float16)


def test_w4a16_dequantize_kernel_matches_codec(device):
    """The Triton dequantize (the "dequant" path's first launch) writes exactly the dense weight
    rounded to fp16 ((q - z) * s is exact in fp32)."""
    packed, dense = _awq_weights(136, 192, 64, device, seed=11)
    w = w4a16_dequantize(packed, torch.float16)
    assert torch.equal(w, dense.to(torch.float16))


def test_w4a16_rejects_wrong_in_features(device):
    packed, _ = _awq_weights(64, 128, 64, device, seed=2)
    with pytest.raises(ValueError, match="in_features 128"):
        w4a16_linear(torch.randn(2, 96, dtype=torch.float16, device=device), packed)


GPU_SHAPES = [  # (N, K, group): DeepSeek dense-MLP and attention projections
    (576, 2048, 64),  # V2-Lite kv_a_proj_with_mqa (512 + 64 rope): 4.5 blocks of 128
    (2048, 2048, 128),  # V2-Lite o_proj
    (3648, 2048, 32),  # V2-Lite q_proj + kv_a_proj fused (the K-block GEMV at M = 1)
    (4096, 512, 64),  # V2-Lite kv_b_proj: K = 4 chunks
    (10944, 2048, 128),  # V2-Lite dense gate / up (tuned configs)
    (2048, 10944, 64),  # V2-Lite dense down: K = 85.5 x 128, so group <= 64
    (2048, 11008, 128),  # down at the group-128 width 11008 = 86 x 128
    (1536, 7168, 128),  # V3 q_a_proj
    (576, 7168, 32),  # V3 kv_a_proj_with_mqa
    (18432, 7168, 128),  # V3 dense gate / up (tuned configs)
    (7168, 18432, 128),  # V3 dense down
]
GPU_M = [1, 2, 3, 4, 16, 64, 128, 512]


def _explicit_configs(m):
    """Non-default configs worth checking at M tokens: the GEMV with an uneven split (M <= 4),
    split-K decode tiles with an uneven split (M <= 64), the MMA tiles where the heuristic would
    dequantize (M >= 256)."""
    if m <= 4:
        return [GemmConfig(1 << (m - 1).bit_length(), 32, 3, 4, 1, path="gemv")]
    if m <= 64:
        return [GemmConfig(max(16, 1 << (m - 1).bit_length()), 128, 3, 4, 4)]
    return [GemmConfig(64, 128, 1, 8, 3)] if m >= 256 else []


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
def test_w4a16_gpu_repack_real_shapes(fmt):
    """At every DeepSeek shape: the repacked layout dequantizes (torch) to exactly the checkpoint's
    weight, and the Triton dequantize to exactly its bf16 rounding."""
    build = _awq_weights if fmt == "awq" else _act_order_gptq
    for n, k, group in GPU_SHAPES:
        packed, dense = build(n, k, group, "cuda", seed=n + k)
        deq = dequantize_w4a16(packed, torch.float64)  # [N, K] in the kernel's K order
        if packed.perm is not None:
            deq = deq[:, torch.argsort(packed.perm.long())]
        assert torch.equal(deq, dense), f"repack {fmt} {n}x{k} g{group}"
        w = w4a16_dequantize(packed, torch.bfloat16)  # kernel K order
        ref = dense if packed.perm is None else dense[:, packed.perm.long()]
        assert torch.equal(w, ref.to(torch.bfloat16)), f"dequantize kernel {fmt} {n}x{k} g{group}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", GPU_SHAPES)
def test_w4a16_gpu_real_shape_bf16(n, k, group):
    """bf16 at a DeepSeek shape, M = 1..512: the default path (GEMV at M <= 2, split-K decode
    tiles to 64, MMA tiles, dequantize + cuBLAS from 256; tuned configs where the table has the
    shape) and the explicit configs equal x @ W^T, whole output and per 128-channel block, into
    poisoned outputs; split-K counters are left zero."""
    packed, dense = _awq_weights(n, k, group, "cuda", seed=n + k)
    for m in GPU_M:
        x = _x(m, k, torch.bfloat16, "cuda", seed=m)
        for cfg in [None, *_explicit_configs(m)]:
            y = w4a16_linear(x, packed, cfg, out=_poisoned(m, n, torch.bfloat16, "cuda"))
            _check(y, x, dense, torch.bfloat16, what=f"M={m} {cfg}")
    assert int(packed.splitk_counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(1536, 7168, 128), (2048, 10944, 64)])
def test_w4a16_gpu_gptq_act_order_bf16(n, k, group):
    """GPTQ act-order at DeepSeek shapes in bf16, M = 1 (GEMV), 4 (tiles), 17, 300 (dequantize +
    cuBLAS with the gathered x): equals x @ W^T in the stored channel order."""
    packed, dense = _act_order_gptq(n, k, group, "cuda", seed=n)
    for m in (1, 4, 17, 300):
        x = _x(m, k, torch.bfloat16, "cuda", seed=m)
        y = w4a16_linear(x, packed, out=_poisoned(m, n, torch.bfloat16, "cuda"))
        _check(y, x, dense, torch.bfloat16, what=f"M={m}")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_slice_codes_round_trip_and_order(group):
    """The paired order: word 16c + i holds k = 128c + 32 (j % 4) + 2i + j // 4 in nibble j (every word
    and nibble checked), and unslice inverts it; repack picks it exactly when K % 128 == 0 and G <= 128."""
    from dsquant.runtime.kernels.gemm.w4a16_repack import slice_codes, unslice_codes

    q = torch.randint(0, 16, (24, 256), dtype=torch.int32, generator=torch.Generator().manual_seed(group))
    words = slice_codes(q)
    assert torch.equal(unslice_codes(words), q)
    for j in range(8):
        for i in range(16):
            k = 32 * (j % 4) + 2 * i + j // 4
            got = (words[:, [i, 16 + i]] >> (4 * j)) & 0xF  # [24, 2]: chunks 0 and 1
            assert torch.equal(got, q[:, [k, 128 + k]]), (j, i)
    assert _awq_weights(72, 256, group, "cpu", seed=1)[0].sliced
    assert not _awq_weights(72, 5 * 64, 64, "cpu", seed=1)[0].sliced  # K = 320: plain order


SLICED_CASES = [  # (M, group, config or None): K = 384, sliced for groups 32 and 64 too; GEMV only by config
    *[(m, g, None) for m in (1, 3, 17, 64, 300) for g in (32, 64)],
    (2, 32, GemmConfig(2, 32, 3, 4, 1, path="gemv")), (1, 64, GemmConfig(1, 64, 2, 2, 1, path="gemv")),
    (1, 128, GemmConfig(1, 64, 3, 2, 1, path="gemv")), (5, 64, GemmConfig(16, 128, 2, 4, 2)),
    (40, 32, GemmConfig(64, 64, 3, 4, 2)), (100, 64, GemmConfig(64, 64, 1, 4, 2)),
    (17, 32, GemmConfig(64, 64, 1, 4, 2, path="dequant")),
    # the K-block GEMV: 2-chunk steps over 3 chunks (the second step half masked), split 2, M = 1 and 2
    (1, 128, GemmConfig(1, 32, 1, 2, 1, path="gemv_kblock", k_chunks=2)),
    (2, 64, GemmConfig(2, 16, 2, 2, 1, path="gemv_kblock", k_chunks=2)),
    (1, 32, GemmConfig(1, 64, 2, 4, 1, path="gemv_kblock", k_chunks=1)),
    (2, 32, GemmConfig(2, 32, 1, 4, 1, path="gemv_kblock", k_chunks=4)),
]


def test_w4a16_sliced_config_paths_by_token_count():
    """Sliced weights: the K-block GEMV at M = 1 on small weights (all of K in one step), the one-chunk
    GEMV at M = 1 above them and at M = 2 on small weights, the MMA kernel otherwise below the
    dequantize sizes."""
    from dsquant.runtime.kernels.gemm.gemm_configs import w4a16_config

    def cfg(m, n, k):
        return w4a16_config(m, n, k, 128, "cpu", sliced=True)

    assert cfg(1, 18432, 7168).path == "gemv" and cfg(1, 18432, 7168).block_n == 64
    assert (cfg(1, 10944, 2048).path, cfg(1, 10944, 2048).block_n, cfg(1, 10944, 2048).split_k) == ("gemv", 64, 8)
    assert (cfg(1, 2048, 2048).path, cfg(1, 2048, 2048).k_chunks, cfg(1, 2048, 2048).split_k) == ("gemv_kblock", 16, 1)
    assert cfg(1, 4096, 512).k_chunks == 4 and cfg(1, 2816, 384).k_chunks == 4
    assert cfg(1, 4096, 7168).path == "gemv" and cfg(1, 8192, 2048).path == "gemv"
    assert cfg(2, 3648, 2048).path == "gemv" and cfg(2, 3648, 2048).block_m == 2
    assert cfg(2, 18432, 7168).path == "fused" and cfg(4, 2048, 2048).path == "fused"
    assert cfg(300, 2048, 2048).path == "dequant"


@pytest.mark.parametrize("m,group,cfg", SLICED_CASES)
def test_w4a16_sliced_matches_reference(device, m, group, cfg):
    """Weights in the paired order on every path (GEMV, the MMA kernel with uneven split-K,
    dequantize + cuBLAS) equal x @ W^T into a poisoned output; N = 136, K = 384 (3 chunks)."""
    n, k = 136, 384
    packed, dense = _awq_weights(n, k, group, device, seed=m * 100 + group)
    assert packed.sliced
    x = _x(m, k, torch.float16, device, seed=m)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, n, torch.float16, device))
    _check(y, x, dense, torch.float16)
    assert int(packed.splitk_counters.abs().sum()) == 0


@pytest.mark.parametrize("m,cfg", [(1, None), (6, None), (33, None), (2, GemmConfig(2, 32, 2, 2, 1, path="gemv")),
                                   (2, GemmConfig(2, 16, 1, 2, 1, path="gemv_kblock", k_chunks=2))])
def test_w4a16_sliced_gptq_act_order(device, m, cfg):
    """GPTQ act-order on the paired order (K = 256, G = 64): the MMA kernel and the GEMV gather
    x[:, perm]."""
    packed, dense = _act_order_gptq(72, 256, 64, device, seed=m)
    assert packed.sliced and packed.perm is not None
    x = _x(m, 256, torch.float16, device, seed=m)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, 72, torch.float16, device))
    _check(y, x, dense, torch.float16)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("prefetch", [True, False])
def test_w4a16_mma_prefetch_and_tile_major(device, group, prefetch):
    """The MMA kernel with the zeros / scales loaded one chunk ahead or in place, on the row-major
    and the tile-major (TILE_N = 64 rows x 16 words contiguous) code orders; split-K 4 over 5 chunks
    leaves one split empty."""
    from dsquant.runtime.kernels.gemm.w4a16_mma import w4a16_mma
    from dsquant.runtime.kernels.gemm.w4a16_repack import slice_codes, codes_nk

    n, k, m = 128, 640, 5
    packed, dense = _awq_weights(n, k, group, device, seed=group + prefetch)
    qs = slice_codes(codes_nk(packed))  # [N, K/8]
    x = _x(m, k, torch.float16, device, seed=3)
    for tile_n in (0, 64):
        q = qs if not tile_n else qs.view(n // 64, 64, k // 128, 16).permute(0, 2, 1, 3).contiguous()
        y = w4a16_mma(x, q, packed.scales, packed.zeros, group, _poisoned(m, n, torch.float16, device),
                      64, 16, 4, tile_n=tile_n, prefetch=prefetch)
        _check(y, x, dense, torch.float16, f"tile_n {tile_n}")
