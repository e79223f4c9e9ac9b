"""Click options shared by the commands, spelled the way vLLM spells them.

Each option is declared once here. `device_option` is used by every command that runs a model;
`engine_options` by `serve` and `generate`, whose commands take the values as keyword arguments
and turn them into an EngineConfig with `engine_config`; `bench serve --artifact` takes
`max_model_len_option` and `max_num_seqs_option` with `serve`. Flag errors are DsquantErrors: `dsquant` prints one line and
exits 2.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from dsquant.errors import DsquantError

DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32"}


def check_device(ctx, param, value: str | None) -> str | None:
    """`--device cuda` on a machine without a usable GPU is a one-line error, not a torch traceback."""
    if value == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DsquantError("--device cuda: no CUDA device is available (use --device cpu)")
    return value


def device_option(help: str = "cuda or cpu. Default: cuda when available."):
    return click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, callback=check_device,
                        help=help)


def max_model_len_option(help: str = "Longest prompt + output in tokens. Default: the model config's."):
    return click.option("--max-model-len", default=None, type=click.IntRange(min=2), help=help)


def max_num_seqs_option(help: str = "Requests running at once (one engine batch); more wait in the queue."):
    return click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(min=1), help=help)


def _check_kv_cache_dtype(ctx, param, value: str) -> str:
    from dsquant.runtime.layers.kv_cache import check_kv_cache_dtype

    return check_kv_cache_dtype(value, "--kv-cache-dtype")


KV_CACHE_DTYPE_HELP = ("KV cache dtype: auto (the model dtype) or fp8 (e4m3 with a dynamic scale per token and "
                       "kv head, or FlashMLA's 656-byte token for MLA: about 1.75-1.9x the tokens in the same memory).")


def kv_cache_dtype_option():
    """--kv-cache-dtype auto|fp8, for the commands that run the engine outside engine_options."""
    return click.option("--kv-cache-dtype", default="auto", show_default=True, callback=_check_kv_cache_dtype,
                        help=KV_CACHE_DTYPE_HELP)


def tensor_parallel_option():
    """-tp / --tensor-parallel-size, for the engine options and the commands that run the engine outside them."""
    return click.option("-tp", "--tensor-parallel-size", default=1, show_default=True, type=click.IntRange(min=1),
                        help="Processes to split the model over: one per GPU on cuda, gloo processes on cpu.")


def _check_tokenizer(ctx, param, value: str | None) -> str | None:
    if value is not None and not (Path(value) / "tokenizer.json").is_file():
        raise DsquantError(f"--tokenizer {value}: expected a directory holding tokenizer.json")
    return value


_ENGINE_OPTIONS = [
    device_option(),
    click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
                 help="Dtype of activations and unquantized weights; auto: the checkpoint's."),
    max_model_len_option(),
    tensor_parallel_option(),
    click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
                 help="Launch each engine step before reading the previous one's tokens."),
    click.option("--enforce-eager", is_flag=True, help="Run eagerly: no CUDA graphs."),
    click.option("--num-scheduler-steps", default=1, show_default=True, type=click.IntRange(min=1),
                 help="Decode steps one launch may run back to back on the device (multi-step decoding): the "
                      "engine's host work is paid once per launch; tokens of a launch arrive together."),
    click.option("--seed", default=None, type=int,
                 help="Seed of the engine's sampling generator (requests without a seed of their own). "
                      "Default: 0."),
    click.option("--max-num-batched-tokens", default=2048, show_default=True, type=click.IntRange(min=1),
                 help="Tokens one engine step may run (prefill chunks included)."),
    click.option("--long-prefill-token-threshold", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Cap a prompt's chunk at this many tokens in steps that also run decodes, so a long "
                      "prompt does not stall the streams beside it; 0: no cap."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
                 help="Reuse the KV blocks of prompt prefixes seen before."),
    click.option("--gpu-memory-utilization", default=0.9, show_default=True,
                 type=click.FloatRange(0, 1, min_open=True),
                 help="Fraction of GPU memory for weights, activations and the KV cache (cuda)."),
    kv_cache_dtype_option(),
    click.option("--tokenizer", default=None, type=click.Path(file_okay=False, path_type=str),
                 callback=_check_tokenizer,
                 help="Directory with tokenizer.json (and tokenizer_config.json). Default: the model's."),
    click.option("--chat-template", default=None,
                 help="Jinja chat template: a file path or the template text. Default: the tokenizer's."),
]
ENGINE_KEYS = ("device", "dtype", "max_model_len", "tensor_parallel_size", "async_scheduling", "enforce_eager",
               "num_scheduler_steps",
               "seed", "max_num_batched_tokens", "long_prefill_token_threshold", "enable_prefix_caching",
               "gpu_memory_utilization", "kv_cache_dtype", "tokenizer", "chat_template")


def engine_options(f):
    """Adds the engine options (ENGINE_KEYS) to a command, in a fixed order in --help."""
    for option in reversed(_ENGINE_OPTIONS):
        f = option(f)
    return f


def pop_engine_options(kwargs: dict) -> dict:
    """The engine options' values, removed from a command's kwargs."""
    return {k: kwargs.pop(k) for k in ENGINE_KEYS}


def engine_config(opts: dict, **extra):
    """An EngineConfig from engine option values (pop_engine_options) plus EngineConfig fields."""
    import torch

    from dsquant.runtime.engine.llm_engine import EngineConfig

    dtype = DTYPES[opts["dtype"]]
    return EngineConfig(
        device=opts["device"], dtype=getattr(torch, dtype) if dtype else None, max_model_len=opts["max_model_len"],
        tensor_parallel_size=opts["tensor_parallel_size"], async_scheduling=opts["async_scheduling"],
        enforce_eager=opts["enforce_eager"], num_scheduler_steps=opts["num_scheduler_steps"],
        seed=opts["seed"] if opts["seed"] is not None else 0,
        max_num_batched_tokens=opts["max_num_batched_tokens"],
        long_prefill_token_threshold=opts["long_prefill_token_threshold"],
        enable_prefix_caching=opts["enable_prefix_caching"],
        gpu_memory_utilization=opts["gpu_memory_utilization"], kv_cache_dtype=opts["kv_cache_dtype"],
        tokenizer=opts["tokenizer"], **extra)


def chat_template(value: str | None, tokenizer_dir: str | Path):
    """The ChatTemplate to use: `value` (a file path or inline Jinja text), else the tokenizer
    directory's own (or None). Special tokens come from the tokenizer directory's config."""
    from dsquant.runtime.server.chat_template import ChatTemplate, _token

    if value is None:
        return ChatTemplate.from_dir(tokenizer_dir)
    path = Path(value)
    looks_inline = "{" in value or "\n" in value
    if not looks_inline:
        if not path.is_file():
            raise DsquantError(f"--chat-template {value}: no such file (give a template file or the template text)")
        value, origin = path.read_text(encoding="utf-8"), f" in {path}"
    else:
        origin = " given by --chat-template"
    config_file = Path(tokenizer_dir) / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = {}
    from jinja2 import TemplateSyntaxError

    try:
        return ChatTemplate(value, _token(config.get("bos_token")), _token(config.get("eos_token")), origin)
    except TemplateSyntaxError as e:
        raise DsquantError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
