"""`dsquant bench engine`: the whole engine on a DeepSeek-V2-Lite-shaped model of random weights.

For each scheme (BF16, FP8 block, INT4 RTN AWQ g128; bench.random_model makes the weights on the
GPU, the same draws for every scheme) in one run, with transformers' `generate` on the BF16 model
as the peer:
  - batch-1 decode tokens/s (input 512): 1 / median time between tokens after the first, and its
    fraction of the roofline (bytes one token reads over the copy bandwidth, 4.25 TB/s on an H200:
    every non-expert weight but the embedding, top-k/E of the routed experts, the KV cache);
  - output tokens/s with N concurrent sequences (input 512, output 256; wall time incl. prefill);
  - optionally one long prompt (V2-Lite's YaRN context, 131072) through chunked prefill: TTFT, the
    KV-cache memory it holds, and the time between tokens of short streams decoding beside its
    prefill (engine_long.py);
  - optionally the HTTP serving benchmark (bench.serve_local) at several concurrencies.
The batch-1 and concurrent runs are measured for each --modes stepping of the same engine: "sync"
(each step's tokens read before the next is scheduled) and "async" (EngineConfig.async_scheduling:
step N + 1 launched before step N's tokens are read, engine/async_step.py); keys batch1 /
concurrent and batch1_async / concurrent_async.
Results stream into --json after every measurement, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from dsquant.runtime.engine.timing import sync as _sync
from dsquant.bench.engine_peer import hf_peer
from dsquant.bench.engine_tp import allreduce_per_token, format_tp_table
from dsquant.cli_options import check_device, kv_cache_dtype_option


@dataclass
class EngineBenchSpec:
    schemes: tuple[str, ...] = ("int4", "bf16", "fp8")
    num_layers: int | None = None  # None: the config's (27 for V2-Lite)
    input_len: int = 512
    batch1_output: int = 128
    concurrency: int = 64
    concurrent_output: int = 256
    long_context: int = 0  # prompt length of the long-context request (0: skip)
    long_scheme: str = "int4"
    long_streams: int = 8  # short streams decoding beside the long prompt (engine_long.py; 0: skip)
    long_prefill_thresholds: tuple[int, ...] = (0,)  # beside-streams runs, one per long_prefill_token_threshold
    serve_concurrencies: tuple[int, ...] = ()  # HTTP runs for fp8/int4 (empty: skip)
    serve_output: int = 128
    peer_batches: tuple[int, ...] = (1, 16)  # transformers generate (empty: skip)
    peer_output: int = 32
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.88
    bandwidth_tbs: float = 4.25
    device: str = "cuda"
    seed: int = 0
    modes: tuple[str, ...] = ("sync", "async")  # engine stepping measured: "sync" and/or "async" scheduling
    model: str = "v2-lite"  # the random model's shape: a key of bench.random_model.SHAPES
    config: dict = field(default_factory=dict)  # overrides of that shape (tiny shapes for CPU tests)
    kv_cache_dtype: str = "auto"  # "fp8": the FlashMLA-layout FP8 KV cache
    tensor_parallel_sizes: tuple[int, ...] = (1,)  # each scheme at each size (rows "<scheme>-tp<N>" past 1)
    num_scheduler_steps: int = 1  # decode steps per launch (runtime/engine/multi_step.py)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def run_requests(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Add every prompt, step until done; wall time, output tok/s, median TTFT and time between tokens."""
    from dsquant.runtime.engine.sequence import SamplingParams
    from dsquant.runtime.engine.timing import timed_generate

    run = timed_generate(engine, prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    gaps = run.token_gaps()
    if engine.num_scheduler_steps > 1:  # a burst's tokens arrive together: each request's mean gap
        gaps = [r.tpot_s for r in run.requests if r.output_tokens > 1]
    return {"wall_s": run.wall_s, "output_tokens": run.output_tokens, "output_tok_s": run.output_tokens / run.wall_s,
            "ttft_s": statistics.median(run.ttfts()),
            "tpot_ms": 1e3 * statistics.median(gaps) if gaps else None, "peak_kv_blocks": run.peak_kv_blocks}


def build_engine(scheme: str, spec: EngineBenchSpec, workdir: Path, max_model_len: int, tp: int = 1):
    """(engine, reader, load seconds) for `scheme` on the random model, over `tp` tensor-parallel ranks
    (each makes its shard of the same random draws on its own device); the reader returned is a CPU
    one for the model's layout (nothing drawn)."""
    from dsquant.bench.random_model import SHAPES, RandomReaderSpec, make_config_dir
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    overrides = dict(spec.config)
    if spec.num_layers:
        overrides["num_hidden_layers"] = spec.num_layers
    path = make_config_dir(workdir / scheme, SHAPES[spec.model], scheme, **overrides)
    reader_factory = RandomReaderSpec(path, seed=spec.seed)
    start = time.perf_counter()
    engine = LLMEngine(path, EngineConfig(
        device=spec.device, max_num_seqs=max(spec.concurrency, max(spec.serve_concurrencies, default=1),
                                             spec.long_streams + 1 if spec.long_context else 1),
        max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=max_model_len,
        gpu_memory_utilization=spec.gpu_memory_utilization, verify_checksums=False,
        kv_cache_memory=1 << 30, kv_cache_dtype=spec.kv_cache_dtype, tensor_parallel_size=tp,
        num_scheduler_steps=spec.num_scheduler_steps),
        reader_factory=reader_factory)
    _sync(spec.device)
    return engine, reader_factory("cpu"), time.perf_counter() - start


def bench_scheme(scheme: str, spec: EngineBenchSpec, workdir: Path, emit, tp: int = 1) -> None:
    import torch

    from dsquant.bench.random_model import bytes_per_decode_token
    from dsquant.runtime.fallbacks import kernel_fallbacks

    long_len = spec.long_context if scheme == spec.long_scheme else 0
    max_len = max(spec.input_len + max(spec.concurrent_output, spec.batch1_output, spec.serve_output) + 8,
                  long_len + 16)
    engine, reader, load_s = build_engine(scheme, spec, workdir / f"tp{tp}", max_len, tp)
    vocab = min(engine.model.config.vocab_size, 32000)
    row = {"scheme": scheme if tp == 1 else f"{scheme}-tp{tp}", "tensor_parallel_size": tp, "load_s": load_s,
           "linear_methods": engine.model.linear_methods,
           "kv_blocks": engine.block_manager.num_blocks, "block_size": engine.config.block_size,
           "kv_bytes_per_block": engine.runner.bytes_per_block(), "kv_cache_dtype": engine.runner.kv_spec.label,
           "kernel_fallbacks": kernel_fallbacks(engine.model)}
    if spec.device.startswith("cuda"):
        row["weights_gb"] = torch.cuda.memory_allocated() / 1e9
    roof = bytes_per_decode_token(reader, spec.input_len + spec.batch1_output // 2)
    for mode in spec.modes:  # the same engine, stepped synchronously or with async scheduling
        engine.async_scheduling = mode == "async"
        suffix = "_async" if mode == "async" else ""
        run_requests(engine, _prompts(2, spec.input_len, vocab, 99), 8)  # warm-up: compiles, allocator
        b1 = run_requests(engine, _prompts(1, spec.input_len, vocab, spec.seed), spec.batch1_output)
        decode_tok_s = 1e3 / b1["tpot_ms"]
        bandwidth = spec.bandwidth_tbs * 1e12 * tp  # each rank reads its shard
        row["batch1" + suffix] = {**b1, "decode_tok_s": decode_tok_s, "roofline_bytes": roof,
                                  "roofline_tok_s": bandwidth / roof["total"],
                                  "fraction_of_roofline": decode_tok_s * roof["total"] / bandwidth}
        if tp > 1:
            row["allreduce" + suffix] = allreduce_per_token(engine, _prompts(1, spec.input_len, vocab, spec.seed + 5),
                                                            run_requests)
        emit(row)
        if spec.concurrency:
            # warm-up at the same concurrency on other prompts: the mixed prefill + decode steps reach
            # GEMM / MoE shapes (hence Triton compiles) the batch-1 runs never did; without it the
            # timed run pays those compiles (seconds for INT4's many kernel configs)
            run_requests(engine, _prompts(spec.concurrency, spec.input_len, vocab, spec.seed + 11), 16)
            row["concurrent" + suffix] = {"concurrency": spec.concurrency, **run_requests(
                engine, _prompts(spec.concurrency, spec.input_len, vocab, spec.seed + 1), spec.concurrent_output)}
            emit(row)
    engine.async_scheduling = "async" in spec.modes
    if spec.serve_concurrencies and scheme != "bf16":
        row["serve"] = serve_runs(engine, spec, vocab)
        emit(row)
    if long_len:
        from dsquant.bench.engine_long import long_context_runs

        row["long_context"] = long_context_runs(engine, spec, vocab, long_len, row["kv_bytes_per_block"],
                                                lambda n, length, seed: _prompts(n, length, vocab, seed), run_requests)
        emit(row)
    del engine
    gc.collect()
    if spec.device.startswith("cuda"):
        torch.cuda.empty_cache()


def serve_runs(engine, spec: EngineBenchSpec, vocab: int) -> dict:
    """HTTP benchmark per concurrency (4x as many prompts as the concurrency, at least 4), with the
    offline peer on the prompts of the largest concurrency."""
    import asyncio
    from dataclasses import replace

    from dsquant.bench.serve_client import ServeBenchSpec, run_serve_benchmark
    from dsquant.bench.serve_data import BenchPrompt
    from dsquant.bench.serve_local import device_name, offline_throughput, serve_engine

    top = max(spec.serve_concurrencies)
    ids = _prompts(2 * top, spec.input_len, vocab, spec.seed + 3)
    prompts = [BenchPrompt(token_ids=p) for p in ids]  # sent as token ids
    offline = offline_throughput(engine, prompts, spec.serve_output)
    base = ServeBenchSpec(input_len=spec.input_len, output_len=spec.serve_output)
    runs = []
    with serve_engine(engine, max_queue=max(256, len(prompts))) as url:
        for c in spec.serve_concurrencies:
            sub = prompts[: max(4, 2 * c)]
            r = asyncio.run(run_serve_benchmark(url, replace(base, max_concurrency=c, num_prompts=len(sub)),
                                                sub, device_name(engine)))
            keep = {k: v for k, v in r.items() if not isinstance(v, list)}
            if c == top:
                keep["offline_ratio"] = r["output_throughput"] / offline["output_throughput"]
            runs.append(keep)
    return {"offline": offline, "runs": runs}


def run_engine_bench(spec: EngineBenchSpec, json_path: str | None) -> dict:
    from dsquant.bench.common import environment

    result = {"env": environment(), "spec": asdict(spec), "schemes": {}, "peer": None}

    def emit(row=None):
        if row is not None:
            result["schemes"][row["scheme"]] = row
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=1, default=str))

    if spec.peer_batches:  # first, while the whole GPU is free
        result["peer"] = hf_peer(spec)
        emit()
    with tempfile.TemporaryDirectory() as tmp:
        for tp in spec.tensor_parallel_sizes:
            for scheme in spec.schemes:
                bench_scheme(scheme, spec, Path(tmp), emit, tp)
    return result


def format_table(result: dict) -> str:
    lines = ["| scheme | stepping | batch-1 decode tok/s | roofline tok/s | fraction | vs dsquant bf16 | "
             "concurrent output tok/s | vs dsquant bf16 |", "|---|---|---|---|---|---|---|---|"]
    rows = result["schemes"]
    base = rows.get("bf16", {})
    for mode in result["spec"].get("modes", ("sync",)):
        suffix = "_async" if mode == "async" else ""
        for name, r in rows.items():
            b1, c = r.get("batch1" + suffix, {}), r.get("concurrent" + suffix, {})
            b1_base, c_base = base.get("batch1" + suffix, {}), base.get("concurrent" + suffix, {})
            rel = (lambda a, ref: f"{a / ref:.2f}x" if ref else "-")
            lines.append(f"| {name} | {mode} | {b1.get('decode_tok_s', 0):.1f} | {b1.get('roofline_tok_s', 0):.0f} | "
                         f"{b1.get('fraction_of_roofline', 0):.0%} | "
                         f"{rel(b1.get('decode_tok_s', 0), b1_base.get('decode_tok_s'))} | "
                         f"{c.get('output_tok_s', 0):.0f} | {rel(c.get('output_tok_s', 0), c_base.get('output_tok_s'))} |")
    for p in result.get("peer") or []:
        lines.append(f"| transformers bf16, batch {p['batch']} | | {p['decode_tok_s']:.1f} (decode) | | | | "
                     f"{p['output_tok_s']:.1f} (incl. prefill) | |")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip()) if text else ()


@click.command(name="engine", short_help="Engine decode and throughput on a random V2-Lite-shaped model.")
@click.option("--schemes", default="int4,bf16,fp8", show_default=True, help="Comma list of bf16, fp8, int4.")
@click.option("--model", "model_shape", default="v2-lite", show_default=True,
              type=click.Choice(["v2-lite", "v2", "v3"]),
              help="The random model's shape: DeepSeek-V2-Lite (15.7B), V2 (236B) or V3 (671B); the two large "
                   "ones need --tensor-parallel-size across GPUs for most schemes.")
@click.option("--layers", type=int, default=None, help="Decoder layers (default: the model's).")
@click.option("--input-len", type=int, default=512, show_default=True, help="Prompt tokens.")
@click.option("--batch1-output", type=int, default=128, show_default=True,
              help="Tokens generated in the batch-1 decode run.")
@click.option("--concurrency", type=int, default=64, show_default=True, help="Requests of the concurrent run.")
@click.option("--concurrent-output", type=int, default=256, show_default=True,
              help="Tokens generated per request in the concurrent run.")
@click.option("--long-context", type=int, default=0,
              help="Prompt length of one long request, on int4 (else the first scheme); 0 skips.")
@click.option("--long-streams", type=int, default=8, show_default=True,
              help="Short requests decoding while the long prompt prefills (their time between tokens).")
@click.option("--long-prefill-token-threshold", "long_thresholds", default="0", show_default=True,
              help="The beside-streams run once per value (comma-separated): the long prompt's chunk cap "
                   "while the streams decode (0: none).")
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True,
              help="The engine's token budget per step (the long prompt's chunk size).")
@click.option("--serve", "serve_conc", default="", help="HTTP runs at these concurrencies, e.g. 1,8,32,64.")
@click.option("--peer-batches", default="1,16", show_default=True, help="transformers generate batches ('' skips).")
@click.option("--modes", default="sync,async", show_default=True,
              help="Engine stepping to measure: sync and/or async (async scheduling).")
@click.option("--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]),
              callback=check_device,
              help="cuda, or cpu for the tiny test configs (--config-json).")
@click.option("--config-json", default=None, help="JSON object overriding V2-Lite's config (tiny test models).")
@click.option("--json", "json_path", default=None, help="Write results here (updated as they come).")
@click.option("-tp", "--tensor-parallel-size", "tp_sizes", default="1", show_default=True,
              help="Comma list: every scheme at each size (e.g. 1,2: TP=2 against TP=1 on the same model, "
                   "with the all-reduce time per token); one process per GPU, gloo processes on CPU.")
@kv_cache_dtype_option()
@click.option("--num-scheduler-steps", default=1, show_default=True, type=click.IntRange(min=1),
              help="The engine's decode steps per launch (multi-step decoding).")
def engine(schemes, model_shape, layers, input_len, batch1_output, concurrency, concurrent_output, long_context,
           long_streams, long_thresholds, max_num_batched_tokens, serve_conc,
           peer_batches, modes, device, config_json, json_path, tp_sizes, kv_cache_dtype, num_scheduler_steps):
    """Engine decode and throughput on a V2-Lite-shaped random model, BF16/FP8/INT4, beside transformers."""
    from dsquant.bench.random_model import SCHEMES

    names = tuple(s.strip() for s in schemes.split(",") if s.strip())
    bad = [s for s in names if s not in SCHEMES]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: expected some of {', '.join(SCHEMES)}", param_hint="--schemes")
    mode_names = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not mode_names or any(m not in ("sync", "async") for m in mode_names):
        raise click.BadParameter(f"{modes!r}: expected sync and/or async", param_hint="--modes")
    sizes = _ints(tp_sizes)
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{tp_sizes!r}: expected a comma list of sizes >= 1",
                                 param_hint="--tensor-parallel-size")
    spec = EngineBenchSpec(schemes=names, model=model_shape, num_layers=layers, input_len=input_len,
                           batch1_output=batch1_output,
                           concurrency=concurrency, concurrent_output=concurrent_output, long_context=long_context,
                           long_scheme="int4" if "int4" in names else names[0], long_streams=long_streams,
                           long_prefill_thresholds=_ints(long_thresholds) or (0,),
                           max_num_batched_tokens=max_num_batched_tokens,
                           serve_concurrencies=_ints(serve_conc), peer_batches=_ints(peer_batches),
                           modes=mode_names, device=device,
                           config=json.loads(config_json) if config_json else {}, kv_cache_dtype=kv_cache_dtype,
                           tensor_parallel_sizes=sizes, num_scheduler_steps=num_scheduler_steps)
    result = run_engine_bench(spec, json_path)
    click.echo(format_table(result))
    tp_table = format_tp_table(result)
    if tp_table:
        click.echo("\n" + tp_table)
