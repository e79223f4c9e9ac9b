"""`dsquant validate`: each artifact against the baseline, accuracy and latency side by side."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch

from dsquant.errors import DsquantError
from dsquant.models.layers import Backends
from dsquant.runtime.layers.kv_cache import KVCacheSpec
from dsquant.runtime.layers.kv_roundtrip import KVCacheRoundTrip, KVCacheSwitch
from dsquant.validate.accuracy import compare
from dsquant.validate.latency import LatencySpec, measure_latency, merge_rounds
from dsquant.validate.peers import PEERS, bitsandbytes_available, load_peer
from dsquant.validate.report import ArtifactRow, write_report

BUNDLED_EVAL = ("eval_prose", "eval_code")


@dataclass
class ValidateArgs:
    artifacts: list[str]
    baseline: str
    eval: str = "bundled"  # "bundled" or a path (.txt, .jsonl, .parquet, saved dataset)
    max_ppl_increase: float | None = None  # percent
    out_dir: str = "dsquant-validate"
    device: str = "cpu"
    window: int = 2048  # capped at the model's max_position_embeddings
    stride: int | None = None  # default: window / 2
    max_eval_tokens: int | None = None
    latency: bool = True
    latency_spec: LatencySpec | None = None  # None: LatencySpec.for_device(device)
    peers: bool = True  # bitsandbytes NF4 / INT8 on the baseline, when installed
    lm_eval: str | None = None  # lm-eval tasks (names, paths), run against `dsquant serve` of each checkpoint
    lm_eval_limit: int | None = None  # examples per lm-eval task
    kv_cache_dtype: str = "auto"  # the artifacts' KV cache (the baseline keeps the model dtype's); with fp8,
    # each artifact also gets a row against itself with the model-dtype cache: what the FP8 cache costs
    tensor_parallel_size: int = 1  # > 1: every model runs split over this many processes (tp_accuracy.py)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _runtime_model(path: str, device: str, attention=None):
    """The model as the server builds it (quantized methods; fused MoE on CUDA), full-sequence
    attention: eager, or `attention` (a KVCacheRoundTrip, for the KV cache's numerics)."""
    from dsquant.runtime.loader import load_runtime_model

    backends, prepare = Backends(attention=attention), None
    if device == "cuda":
        from dsquant.runtime.layers.moe import FusedMoE

        moe = FusedMoE()
        backends, prepare = Backends(attention=attention, moe=moe), moe.prepare
    return load_runtime_model(path, backends, dtype=_dtype(device), device=device, prepare_layer=prepare)


def _accuracy_model(path: str, args: ValidateArgs, window: int, attention=None):
    """The model compare() scores: the runtime model, or at tensor_parallel_size > 1 the engine's windows."""
    if args.tensor_parallel_size > 1:
        from dsquant.validate.tp_accuracy import EngineWindows

        return EngineWindows(path, args.device, args.tensor_parallel_size, window, _dtype(args.device))
    return _runtime_model(path, args.device, attention)


def _release(model) -> None:
    if hasattr(model, "close"):  # EngineWindows: stop its workers now, not at exit
        model.close()


def _method(path: str) -> str:
    manifest = Path(path) / "dsquant.json"
    if manifest.is_file():
        return json.loads(manifest.read_text())["recipe"]["name"]
    from dsquant.formats.quantization_config import parse_quantization_config, resolve

    q, source = resolve(path, json.loads((Path(path) / "config.json").read_text()))  # also AutoAWQ/AutoGPTQ side files
    fmt = parse_quantization_config(q, source or "config.json")
    return fmt.method if fmt is not None else "bf16"


def _disk_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def run_validate(args: ValidateArgs, log=print) -> tuple[list[ArtifactRow], dict[str, Path]]:
    from dsquant.assets import resolve_model_dir
    from dsquant.data import eval_tokens
    from dsquant.data.tokenizer import load_tokenizer

    lm_spec = None
    from dsquant.validate.tp_accuracy import check_tp_args

    check_tp_args(args.tensor_parallel_size, args.kv_cache_dtype, args.lm_eval)
    if args.lm_eval is not None:  # fail before any work: lm_eval missing, unknown task
        from dsquant.validate.harness import check_lm_eval, parse_tasks

        lm_version = check_lm_eval()
        lm_spec = parse_tasks(args.lm_eval, args.lm_eval_limit)
    baseline = resolve_model_dir(args.baseline)
    paths = [resolve_model_dir(a) for a in args.artifacts]
    for p in [baseline, *paths]:
        if not Path(p, "config.json").is_file():
            raise DsquantError(f"{p}: not a checkpoint directory (config.json missing)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DsquantError("--device cuda: no CUDA device is available")
    from dsquant.config import load_config

    window = min(args.window, load_config(baseline).max_position_embeddings)
    stride = args.stride or window // 2
    tokenizer = load_tokenizer(baseline)
    sets = list(BUNDLED_EVAL) if args.eval == "bundled" else [args.eval]
    streams = {s: eval_tokens(tokenizer, s, max_tokens=args.max_eval_tokens) for s in sets}
    names = [Path(p).name for p in paths]
    if len(set(names)) != len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    device_label = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    spec = args.latency_spec or LatencySpec.for_device(args.device)

    log(f"baseline {baseline}")
    base_model = _accuracy_model(baseline, args, window)
    rows: list[ArtifactRow] = []
    base_acc = {}
    kv_spec = KVCacheSpec(args.kv_cache_dtype, _dtype(args.device))
    for name, path in zip(names, paths):
        log(f"accuracy: {name}" + (f" (KV cache {kv_spec.label})" if kv_spec.fp8 else ""))
        backend = KVCacheRoundTrip(kv_spec)
        model = _accuracy_model(path, args, window, backend)
        acc = {}
        for s, tokens in streams.items():
            base, res = compare(base_model, {name: model}, tokens, s, window, stride, args.device)
            base_acc[s], acc[s] = base, res[name]
        inc = sum(acc[s].perplexity.value / base_acc[s].perplexity.value - 1 for s in sets) / len(sets) * 100
        method = _method(path) + (f", KV {kv_spec.label}" if kv_spec.fp8 else "")
        rows.append(ArtifactRow(name, path, method, _disk_bytes(path), {s: asdict(a) for s, a in acc.items()}, None,
                                inc, kv_cache_dtype=kv_spec.kv_cache_dtype))
        if kv_spec.fp8:
            log(f"accuracy: {name}, KV cache {kv_spec.label} against {KVCacheSpec('auto', kv_spec.dtype).label}")
            rows.append(_kv_cost_row(name, path, model, backend, kv_spec, streams, window, stride, args.device))
        _release(model)
        del model
    tp = args.tensor_parallel_size
    if args.peers and tp == 1:  # the peers load the baseline in one process
        rows += _peer_rows(args, baseline, base_model, streams, window, stride, base_acc, log)
    _release(base_model)
    del base_model
    rows.insert(0, ArtifactRow("baseline", baseline, "bf16", _disk_bytes(baseline),
                               {s: asdict(a) for s, a in base_acc.items()}, None, 0.0))
    if args.latency:
        timed = [row for row in rows if not row.method.startswith("bitsandbytes") and row.compared_to is None]
        results: dict[int, list] = {id(row): [] for row in timed}
        for r in range(spec.rounds):  # interleaved: A B C, A B C, ...
            for row in timed:
                log(f"latency: {row.name}" + (f" (round {r + 1} of {spec.rounds})" if spec.rounds > 1 else ""))
                results[id(row)].append(measure_latency(row.path, args.device, spec, dtype=_dtype(args.device),
                                                        kv_cache_dtype=row.kv_cache_dtype,  # one dtype for all rows
                                                        tensor_parallel_size=tp))
        for row in timed:
            row.latency = asdict(merge_rounds(results[id(row)]))
            row.notes += [f"runtime fallback: {f}" for f in row.latency["kernel_fallbacks"]]
    if lm_spec is not None:
        _lm_eval_rows(rows, args, lm_spec, log)
    for row in rows[1:]:
        if row.compared_to is not None:  # the KV-cache cost rows: not a gate against the baseline
            continue
        if args.max_ppl_increase is not None and row.ppl_increase_pct > args.max_ppl_increase:
            row.failed_gate = True
            row.notes.append(f"perplexity increase {row.ppl_increase_pct:.2f}% exceeds "
                             f"--max-ppl-increase {args.max_ppl_increase}%")
    meta = {"baseline": baseline, "device": args.device, "device_label": device_label,
            "date": date.today().isoformat(), "window": window, "stride": stride,
            "spec": asdict(spec), "torch": torch.__version__, "kv_cache_dtype": kv_spec.label,
            "tensor_parallel_size": tp,
            "notes": ([] if (bitsandbytes_available() or not args.peers)
                      else ["bitsandbytes not installed: its NF4/INT8 peers were not run"])
            + ([f"tensor-parallel size {tp}: every window ran as one prefill through the serving engine, split "
                f"over {tp} processes; the bitsandbytes peers (one process) were not run"] if tp > 1 else [])}
    if lm_spec is not None:
        meta["lm_eval"] = {"version": lm_version, "tasks": lm_spec.tasks, "limit": lm_spec.limit,
                           "model": "local-completions over dsquant serve"}
    return rows, write_report(rows, sets, meta, Path(args.out_dir))


def _kv_cost_row(name, path, model, backend, kv_spec, streams, window, stride, device) -> ArtifactRow:
    """The artifact with the FP8 cache against itself with the model-dtype cache (KL, top-1, ppl +%)."""
    auto = KVCacheSpec("auto", kv_spec.dtype)
    ref, fp8 = KVCacheSwitch(model, backend, auto), KVCacheSwitch(model, backend, kv_spec)
    ref_acc, acc = {}, {}
    for s, tokens in streams.items():
        ref_acc[s], res = compare(ref, {name: fp8}, tokens, s, window, stride, device)
        acc[s] = res[name]
    inc = sum(acc[s].perplexity.value / ref_acc[s].perplexity.value - 1 for s in acc) / len(acc) * 100
    row = ArtifactRow(f"{name} [KV {kv_spec.label} vs {auto.label}]", path, f"KV cache {kv_spec.label}", 0,
                      {s: asdict(a) for s, a in acc.items()}, None, inc, kv_cache_dtype=kv_spec.kv_cache_dtype,
                      compared_to=f"{name} with the {auto.label} KV cache")
    row.notes.append(f"KL, top-1 and ppl +% of the {kv_spec.label} KV cache against the {auto.label} cache, "
                     "same weights")
    return row


def _peer_rows(args, baseline, base_model, streams, window, stride, base_acc, log) -> list[ArtifactRow]:
    """bitsandbytes peers on the same windows; a peer that fails to load or run becomes a note."""
    if not bitsandbytes_available():
        return []
    rows = []
    for name in PEERS:
        log(f"accuracy: {name} (peer)")
        try:
            model, notes = load_peer(name, baseline, args.device)
            acc = {s: compare(base_model, {name: model}, t, s, window, stride, args.device)[1][name]
                   for s, t in streams.items()}
        except Exception as e:  # a peer's failure must not cost the report
            row = ArtifactRow(name, baseline, f"bitsandbytes {name[4:]}", 0, {}, None, float("nan"))
            row.notes.append(f"peer failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(row)
            continue
        inc = sum(acc[s].perplexity.value / base_acc[s].perplexity.value - 1 for s in acc) / len(acc) * 100
        row = ArtifactRow(name, baseline, f"bitsandbytes {name[4:]}", 0, {s: asdict(a) for s, a in acc.items()},
                          None, inc)
        row.notes += notes
        rows.append(row)
    return rows


def _lm_eval_rows(rows: list[ArtifactRow], args: ValidateArgs, spec, log) -> None:
    """lm-eval scores on each dsquant-served row; a failure becomes the row's note (its server is stopped)."""
    from dsquant.validate.harness import run_lm_eval

    if args.device == "cuda":
        torch.cuda.empty_cache()  # the servers size their KV caches from the free GPU memory
    for row in rows:
        if row.method.startswith("bitsandbytes") or row.compared_to is not None:
            continue
        try:
            row.lm_eval = run_lm_eval(row.path, row.name, args.device, spec, Path(args.out_dir), log,
                                      kv_cache_dtype=row.kv_cache_dtype)
        except Exception as e:  # hours of accuracy work must still reach the report
            row.notes.append(f"lm-eval failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def set_cpu_threads() -> None:
    """On CPU, oversubscribed BLAS threads cost more than they give for small models."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
