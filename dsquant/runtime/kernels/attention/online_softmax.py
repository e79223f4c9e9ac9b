"""Online-softmax pieces the attention kernels share.

Lazy rescaling (FlashAttention-4's conditional rescale): a flash-attention loop keeps, per row, a
reference maximum m_i, the sum l_i of exp2(s - m_i) and the accumulator acc = sum exp2(s - m_i) v.
The classic update moves m_i to every tile's new maximum and rescales acc [ROWS, D] by
exp2(m_old - m_new) each tile, which for a wide accumulator (MLA's 512 latent columns, a 128-wide
head over 128 rows) is most of the CUDA-core work. `rescale_lazily` moves m_i, and rescales, only
when some row's maximum has grown by more than LAZY_TAU (log2 units); between moves the
probabilities exp2(s - m_i) reach at most 2^LAZY_TAU = 256, which bf16 / fp16 (same relative
rounding at any magnitude) and the fp32 sums hold as well as values in [0, 1]. The final
acc / l_i and a split's log-sum-exp m_i + log2(l_i) are exact for any reference m_i.

One catch: with the classic update a row's largest probability is exactly 1, so rounding p to the
dot's dtype leaves the dominant term exact; lazily it is up to 256 and rounds like the others, and
acc (rounded p) over l (unrounded p) is no longer a convex combination. Callers therefore sum the
rounded p into l_i. On an H200 the lazy prefill kernel without that sum was twice as far from SDPA's
output (0.002 against 0.001); with it, on the CPU in fp16, it matches the classic update.
"""
import triton
import triton.language as tl

LAZY_TAU = tl.constexpr(8.0)


@triton.jit
def rescale_lazily(acc, m_i, l_i, m_tile):
    """acc [ROWS, D], m_i / l_i [ROWS], m_tile [ROWS] (this tile's row maxima, scaled, base 2) ->
    (acc, m_i, l_i) with m_i moved to max(m_i, m_tile) and acc, l_i rescaled, if and only if some row
    grew by more than LAZY_TAU; the caller then adds p = exp2(s - m_i) (p <= 2^LAZY_TAU)."""
    m_new = tl.maximum(m_i, m_tile)
    if tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > LAZY_TAU:  # (-inf) - (-inf) kept out
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    return acc, m_i, l_i
