"""`dsquant bench serve`: TTFT, TPOT, ITL and throughput of an OpenAI server under load.

Two modes:
- `--url URL`: a running server (dsquant serve, vLLM, SGLang, ...) streamed /v1/completions.
- `--artifact PATH`: loads the artifact, serves it in-process on a loopback port, runs each
  --max-concurrency, and measures the engine's offline throughput on the same prompts; each
  run reports its output throughput as a fraction of offline (`offline_ratio`).

--json writes vLLM benchmark_serving's fields: one run's dict as is, or several runs as
{"runs": [...], "offline": {...}}. Python entries: `run_serve_benchmark` (serve_client),
`serve_engine`, `offline_throughput`, `run_local_benchmark` (serve_local).
"""
from __future__ import annotations

import json
import math
import os

import click

from dsquant.cli_options import device_option, max_model_len_option, max_num_seqs_option
from dsquant.errors import DsquantError

__all__ = ["serve", "format_table"]


def _concurrencies(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DsquantError(f"--max-concurrency {text!r}: expected integers separated by commas, "
                           "e.g. 1,8,32,64") from None
    if not values or min(values) < 1:
        raise DsquantError(f"--max-concurrency {text!r}: every value must be at least 1")
    return values


def _ms3(r: dict, name: str) -> str:
    return f"{r[f'mean_{name}_ms']:.1f} / {r[f'median_{name}_ms']:.1f} / {r[f'p99_{name}_ms']:.1f}"


def format_table(runs: list[dict], offline: dict | None = None) -> str:
    """One row per run; the offline peer's line and the first error messages below it."""
    head = (f"{'conc':>5} {'rate':>6} {'done':>5} {'fail':>5} {'dur s':>7} {'req/s':>7} {'out tok/s':>10} "
            f"{'tot tok/s':>10}  {'TTFT ms mean/med/p99':>24}  {'TPOT ms mean/med/p99':>22}  "
            f"{'ITL ms mean/med/p99':>22}")
    lines = [head + ("  vs offline" if offline else ""), "-" * (len(head) + (12 if offline else 0))]
    for r in runs:
        conc = r["max_concurrency"] or "-"
        row = (f"{conc:>5} {r['request_rate']:>6} {r['completed']:>5} {r['failed']:>5} {r['duration']:>7.2f} "
               f"{r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} {r['total_token_throughput']:>10.1f}"
               f"  {_ms3(r, 'ttft'):>24}  {_ms3(r, 'tpot'):>22}  {_ms3(r, 'itl'):>22}")
        if offline:
            row += f"  {r['offline_ratio']:>10.1%}"
        lines.append(row)
    if offline:
        lines.append(f"offline peer (all {offline['num_prompts']} prompts added at once, engine.step until done, "
                     f"max_num_seqs {offline['max_num_seqs']}): {offline['output_throughput']:.1f} output tok/s, "
                     f"{offline['total_token_throughput']:.1f} total tok/s, {offline['duration']:.2f} s")
    messages = list(dict.fromkeys(m for r in runs for m in r["error_messages"]))
    for m in messages[:5]:
        lines.append(f"error: {m}")
    return "\n".join(lines)


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


@click.command(name="serve", short_help="Load-test an OpenAI server: TTFT, TPOT, ITL, throughput.")
@click.option("--url", default=None, help="Base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--artifact", default=None, help="Instead of --url: load this artifact (or bundled model) and serve "
              "it in-process; also measures the offline peer.")
@click.option("--model", default=None, help="Model name to request. Default: the first of GET /v1/models.")
@click.option("--api-key", default=None, envvar="DSQUANT_API_KEY", help="Sent as `Authorization: Bearer KEY`.")
@click.option("--dataset", type=click.Choice(["random", "corpus"]), default="random", show_default=True,
              help="random token text, or slices of --corpus.")
@click.option("--corpus", default="eval_prose", show_default=True,
              help="Text set for --dataset corpus: eval_prose, eval_code, calibration or a local source.")
@click.option("--tokenizer", default=None, help="Directory with tokenizer.json for the prompts. Default: the "
              "artifact's with --artifact, else dsquant's bundled tokenizer.")
@click.option("--input-len", default=128, show_default=True, type=click.IntRange(min=1), help="Prompt tokens.")
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(min=1),
              help="Tokens generated per request.")
@click.option("--num-prompts", default=100, show_default=True, type=click.IntRange(min=1), help="Requests sent.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the prompts and arrivals.")
@click.option("--request-rate", default="inf", show_default=True,
              help="Requests per second (Poisson arrivals); inf sends all at once.")
@click.option("--max-concurrency", default=None, help="Requests in flight at most; a list such as 1,8,32,64 runs "
              "each in turn. Default: no limit.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Sampling temperature of the requests (0: greedy).")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds per request.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results here.")
@device_option(help="--artifact only. Default: cuda when available.")
@max_num_seqs_option(help="--artifact only.")
@max_model_len_option(help="--artifact only. Default: the config's.")
def serve(url, artifact, model, api_key, dataset, corpus, tokenizer, input_len, output_len, num_prompts, seed,
          request_rate, max_concurrency, temperature, timeout, json_path, device, max_num_seqs, max_model_len) -> None:
    """Load-test /v1/completions (streamed): TTFT, TPOT, ITL, throughput; vLLM's JSON fields."""
    import asyncio

    from dsquant.bench.serve_client import ServeBenchSpec, run_serve_benchmark

    if (url is None) == (artifact is None):
        raise DsquantError("pass exactly one of --url (a running server) and --artifact (serve it in-process)")
    try:
        rate = float(request_rate)
    except ValueError:
        raise DsquantError(f"--request-rate {request_rate!r}: expected a number or inf") from None
    if not rate > 0:
        raise DsquantError(f"--request-rate must be positive, got {request_rate}")
    levels = _concurrencies(max_concurrency)
    spec = ServeBenchSpec(num_prompts=num_prompts, input_len=input_len, output_len=output_len, request_rate=rate,
                          dataset=dataset, corpus=corpus, seed=seed, model=model, api_key=api_key,
                          tokenizer=tokenizer, temperature=temperature, timeout_s=timeout)
    offline = None
    if artifact is not None:
        runs, offline, where = _run_artifact(artifact, spec, levels, device, max_num_seqs, max_model_len)
    else:
        from dataclasses import replace

        runs = [asyncio.run(run_serve_benchmark(url, replace(spec, max_concurrency=c))) for c in levels]
        where = runs[0]["url"]
    rate_text = "all at once" if math.isinf(rate) else f"{rate:g} req/s Poisson"
    click.echo(f"dsquant bench serve: {runs[0]['model']} at {where}, {num_prompts} {dataset} prompts "
               f"{input_len} in / {output_len} out, {rate_text}, device {runs[0]['device'] or 'unknown'}")
    click.echo(format_table(runs, offline))
    if json_path:
        _write_json(json_path, runs[0] if len(runs) == 1 and offline is None else {"runs": runs, "offline": offline})
    if all(r["completed"] == 0 for r in runs):
        first = runs[0]["error_messages"][0] if runs[0]["error_messages"] else "none recorded"
        raise DsquantError(f"every request failed; the first error: {first}")


def _run_artifact(artifact, spec, levels, device, max_num_seqs, max_model_len):
    from dsquant.bench.serve_local import run_local_benchmark
    from dsquant.assets import resolve_model_dir
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    path = resolve_model_dir(artifact)
    if not os.path.isdir(path):
        raise DsquantError(f"--artifact {artifact}: no such directory or bundled model")
    engine = LLMEngine(path, EngineConfig(device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len))
    report = run_local_benchmark(engine, spec, levels, model_name=spec.model)
    return report["runs"], report["offline"], f"{path} (in-process)"
