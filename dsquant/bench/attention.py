"""`dsquant bench attention`: paged decode / prefill kernels beside F.scaled_dot_product_attention.

Rows (issue 10, item 7), all bf16, random inputs, pages scattered at random over the cache:
- GQA decode (B, Hq, Hkv, L, D): dsquant's paged kernel vs SDPA (enable_gqa) on contiguous K/V
  holding the same values; achieved KV-read GB/s = 2 * B * L * Hkv * D * 2 bytes / time.
- MLA decode, 16 and 128 heads (V2-Lite, V3), latent 512 + rope 64, B x L grid: achieved latent
  cache read TB/s = B * L * 576 * 2 bytes / time, vs SDPA over the unabsorbed per-head K (192) and
  V (128) expanded from the same latent (skipped where those would not fit in --peer-gb); the
  check column is ||W_UV(ours) - sdpa|| / ||sdpa||.
- GQA prefill (causal, no context) vs SDPA is_causal on the same K/V: TFLOP/s.
Times are medians of CUDA-graph replays (triton do_bench_cudagraph) with eager launches beside.
--sweep also times a few alternative launch configs per row and reports the fastest.
--kv-cache-dtype fp8 adds the FP8-cache rows (attention_fp8.py): each decode kernel over the FP8
cache against itself over the bf16 cache.
"""
from __future__ import annotations

import math
import click

from dsquant.bench.attention_common import RANK, ROPE, Row, _paged_copy, _rel, _time
from dsquant.cli_options import kv_cache_dtype_option

GQA_SHAPES = [(1, 32, 8, 32768, 128), (32, 32, 8, 4096, 128), (64, 32, 8, 8192, 128)]
MLA_HEADS, MLA_BATCHES, MLA_LENS = (16, 128), (1, 32, 64), (4096, 32768)
NOPE, V_DIM = 128, 128
YARN_MSCALE = 0.1 * math.log(40.0) + 1.0  # DeepSeek-V3: mscale_all_dim 1.0, factor 40


def _graph_only(fn) -> float:
    import triton.testing as tt

    return tt.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def _sweep(run, configs) -> list:
    """[(graph us, config)] fastest first."""
    return sorted((_graph_only(lambda c=c: run(c)), str(c)) for c in configs)


def _best(tried: list) -> tuple[str, list | None]:
    return (f"{tried[0][0]:.1f}us {tried[0][1]}", tried) if tried else ("", None)


def _gqa_decode(shape, block_size, sweep, gen, dev="cuda") -> Row:
    import torch
    import torch.nn.functional as F

    from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention

    batch, hq, hkv, length, dim = shape
    bf16 = torch.bfloat16 if dev == "cuda" else torch.float16
    q = torch.randn(batch, hq, dim, device=dev, dtype=bf16)
    k = torch.randn(batch, length, hkv, dim, device=dev, dtype=bf16)  # [B, L, Hkv, D]
    v = torch.randn_like(k)
    k_cache, table = _paged_copy(k, block_size, gen)
    v_cache = torch.empty_like(k_cache)
    v_cache[table.long().flatten()] = v.reshape(-1, block_size, hkv, dim)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    k_sdpa, v_sdpa = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    del k, v
    scale = 1.0 / math.sqrt(dim)
    out = torch.empty_like(q)

    def ours(config=DecodeConfig()):
        return paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_seq_len=length, config=config, out=out)

    def peer():
        return F.scaled_dot_product_attention(q[:, :, None], k_sdpa, v_sdpa, scale=scale, enable_gqa=True)

    check = _rel(ours(), peer()[:, :, 0])
    (g, e), (pg, pe) = _time(ours), _time(peer)
    tried = []
    if sweep:
        configs = [DecodeConfig(block_n=bn, num_warps=w, num_stages=s, num_splits=sp)
                   for bn, w, s in [(64, 4, 3), (32, 4, 4), (128, 8, 3), (64, 8, 4), (64, 4, 2)]
                   for sp in (0, 2 * max(1, 132 * 4 // (batch * hkv)))]
        tried = _sweep(ours, configs)
    bytes_read = 2 * batch * length * hkv * dim * 2
    return Row("gqa_decode", f"B={batch} Hq={hq} Hkv={hkv} L={length} D={dim} bs={block_size}", g, e, pg, pe,
               pg / g, bytes_read / g / 1e3, "GB/s", check, str(DecodeConfig()), *_best(tried))


def _mla_decode(heads, batch, length, block_size, peer_gb, sweep, gen, dev="cuda") -> Row:
    import torch
    import torch.nn.functional as F

    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, default_config, mla_decode_attention

    bf16 = torch.bfloat16 if dev == "cuda" else torch.float16
    latent = torch.randn(batch, length, RANK + ROPE, device=dev, dtype=bf16)  # [B, L, 576]
    cache, table = _paged_copy(latent, block_size, gen)
    w_uk = torch.randn(heads, NOPE, RANK, device=dev, dtype=bf16) / math.sqrt(RANK)
    w_uv = torch.randn(heads, V_DIM, RANK, device=dev, dtype=bf16) / math.sqrt(RANK)
    q_nope = torch.randn(batch, heads, NOPE, device=dev, dtype=bf16)
    q_pe = torch.randn(batch, heads, ROPE, device=dev, dtype=bf16)
    q_abs = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk.float()).to(bf16)  # [B, H, 512]
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    scale = YARN_MSCALE**2 / math.sqrt(NOPE + ROPE)
    out = torch.empty_like(q_abs)

    def ours(config=None):  # None: mla_decode.default_config
        return mla_decode_attention(q_abs, q_pe, cache, table, lens, scale, max_seq_len=length, config=config, out=out)

    g, e = _time(ours)
    pg = pe = check = None
    need_gb = batch * heads * length * (NOPE + ROPE + V_DIM) * 2 / 1e9
    if need_gb <= peer_gb:
        k = torch.empty(batch, heads, length, NOPE + ROPE, device=dev, dtype=bf16)  # [B, H, L, 192]
        v = torch.empty(batch, heads, length, V_DIM, device=dev, dtype=bf16)  # [B, H, L, 128]
        for b in range(batch):
            k[b, :, :, :NOPE] = torch.einsum("lr,hnr->hln", latent[b, :, :RANK], w_uk)
            k[b, :, :, NOPE:] = latent[b, None, :, RANK:]
            v[b] = torch.einsum("lr,hvr->hlv", latent[b, :, :RANK], w_uv)
        q_full = torch.cat([q_nope, q_pe], -1)[:, :, None]  # [B, H, 1, 192]

        def peer():
            return F.scaled_dot_product_attention(q_full, k, v, scale=scale)

        ref = peer()[:, :, 0]  # [B, H, 128]
        check = _rel(torch.einsum("bhr,hvr->bhv", ours().float(), w_uv.float()), ref)
        pg, pe = _time(peer)
        del k, v
    tried = []
    if sweep:
        if heads <= 16:
            shapes = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 1), (16, 32, 8, 2), (16, 64, 8, 2)]
        else:
            shapes = [(64, 32, 8, 2), (64, 16, 8, 2), (64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 1), (32, 32, 8, 2)]
        configs = [MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=s, num_splits=sp)
                   for bh, bn, w, s in shapes for sp in (0, 8, 32)]
        tried = _sweep(ours, configs)
    bytes_read = batch * length * (RANK + ROPE) * 2
    return Row("mla_decode", f"H={heads} B={batch} L={length} bs={block_size}", g, e, pg, pe,
               pg / g if pg else None, bytes_read / g / 1e3, "GB/s", check, str(default_config(cache, heads)),
               *_best(tried))


PREFILL_SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
                 (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2)]  # (block_m, block_n, num_warps, num_stages)


def _gqa_prefill(batch, hq, hkv, length, dim, block_size, sweep, gen, dev="cuda") -> Row:
    import torch
    import torch.nn.functional as F

    from dsquant.runtime.kernels.attention.paged_prefill import PrefillConfig, paged_prefill_attention

    bf16 = torch.bfloat16 if dev == "cuda" else torch.float16
    t = batch * length  # q, k, v as views of one fused projection output, as the runtime has them
    qkv = torch.randn(t, (hq + 2 * hkv) * dim, device=dev, dtype=bf16)
    q, k_new, v_new = (x.view(t, -1, dim) for x in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1))
    k, v = k_new.view(batch, length, hkv, dim), v_new.view(batch, length, hkv, dim)
    k_cache, table = _paged_copy(k, block_size, gen)
    v_cache = torch.empty_like(k_cache)
    v_cache[table.long().flatten()] = v.reshape(-1, block_size, hkv, dim)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * length
    q4 = q.view(batch, length, hq, dim).transpose(1, 2)  # [B, Hq, L, D]
    k4, v4 = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    scale = 1.0 / math.sqrt(dim)
    out = torch.empty_like(q)

    def ours(config=None):  # None: the runtime's choice (the TMA kernel on Hopper, new keys from k_new / v_new)
        return paged_prefill_attention(q, k_cache, v_cache, table, lens, cu, scale, max_q_len=length, config=config,
                                       out=out, k_new=k_new, v_new=v_new)

    def peer():
        return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, is_causal=True, enable_gqa=True)

    check = _rel(ours().view(batch, length, hq, dim).transpose(1, 2), peer())
    (g, e), (pg, pe) = _time(ours), _time(peer)
    tried = []
    if sweep:
        tried = _sweep(ours, [PrefillConfig(*c) for c in PREFILL_SWEEP])
    flops = 4 * batch * hq * dim * length * (length + 1) / 2
    return Row("gqa_prefill", f"B={batch} Hq={hq} Hkv={hkv} L={length} D={dim} bs={block_size}", g, e, pg, pe,
               pg / g, flops / g / 1e6, "TFLOP/s", check, _prefill_config(q, k_new, v_new, k_cache), *_best(tried))


def _prefill_config(q, k_new, v_new, k_cache) -> str:
    from dsquant.runtime.kernels.attention import prefill_tma
    from dsquant.runtime.kernels.attention.paged_prefill import PrefillConfig

    return str(prefill_tma.TMAPrefillConfig() if prefill_tma.supported(q, k_new, v_new, k_cache) else PrefillConfig())


def _print(rows) -> None:
    head = f"{'kind':11} {'shape':40} {'graph us':>9} {'eager us':>9} {'peer g us':>9} {'peer e us':>9} " \
           f"{'x peer':>6} {'achieved':>15} {'check':>8}"
    click.echo(head)
    for r in rows:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        click.echo(f"{r.kind:11} {r.shape:40} {r.dsquant_graph_us:9.1f} {r.dsquant_eager_us:9.1f} "
                   f"{fmt(r.peer_graph_us, '9.1f'):>9} {fmt(r.peer_eager_us, '9.1f'):>9} "
                   f"{fmt(r.speedup_vs_peer, '6.2f'):>6} {r.achieved:9.0f} {r.unit:5} {fmt(r.check, '8.1e'):>8}"
                   + (f"  sweep best {r.best_sweep}" if r.best_sweep else ""))


@click.command("attention", short_help="Paged attention kernels vs SDPA (GPU).")
@click.option("--json", "json_path", default=None, help="Write rows and environment to this JSON file.")
@click.option("--block-size", default=64, show_default=True, type=click.Choice(["16", "32", "64"]),
              help="KV cache block size (tokens per block).")
@click.option("--peer-gb", default=24.0, show_default=True, help="Largest expanded K/V (GB) built for the MLA peer.")
@click.option("--sweep", is_flag=True, help="Also time alternative launch configs per row and report the fastest.")
@kv_cache_dtype_option()
def attention(json_path, block_size, peer_gb, sweep, kv_cache_dtype) -> None:
    """Paged GQA/MLA decode and GQA prefill vs F.scaled_dot_product_attention (CUDA GPU)."""
    import torch

    from dsquant.bench.common import environment, write_json
    from dsquant.errors import DsquantError

    if not torch.cuda.is_available():
        raise DsquantError("bench attention needs a CUDA GPU")
    block_size = int(block_size)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in GQA_SHAPES:
        rows.append(_gqa_decode(shape, block_size, sweep, gen))
        _print(rows[-1:])
    for heads in MLA_HEADS:
        for batch in MLA_BATCHES:
            for length in MLA_LENS:
                rows.append(_mla_decode(heads, batch, length, block_size, peer_gb, sweep, gen))
                _print(rows[-1:])
                torch.cuda.empty_cache()
    rows.append(_gqa_prefill(4, 32, 8, 4096, 128, block_size, sweep, gen))
    if kv_cache_dtype == "fp8":
        from dsquant.bench.attention_fp8 import fp8_rows

        rows += fp8_rows(block_size, gen, lambda row: _print([row]))
    click.echo(f"\n{environment()}")
    _print(rows)
    write_json(json_path, rows, {"block_size": block_size})
