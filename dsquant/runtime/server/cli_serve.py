"""`dsquant serve ARTIFACT`: the OpenAI-compatible server under uvicorn.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
--shutdown-timeout seconds, aborts what is left, stops the engine loop and exits 0. uvicorn
would re-raise the signal after its graceful shutdown (exit status 143); dsquant's server class
keeps the handling and drops the re-raise, since a drained shutdown is a clean exit.

Limits and guards: request bodies over --max-request-bytes get 413; --api-key (or
DSQUANT_API_KEY, or VLLM_API_KEY) must not be empty; POST bodies must be application/json; the
Host header must name the server (--allowed-hosts; by default the bound address, or the loopback
names when bound to loopback); CORS headers only for --allowed-origins.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import threading
from pathlib import Path

import click

from dsquant.cli_options import (chat_template, engine_config, engine_options, max_num_seqs_option,
                                 pop_engine_options)
from dsquant.errors import DsquantError


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted sockets inherit it (Linux): without it a response's body waits ~40 ms behind its headers
    # (Nagle's algorithm against the client's delayed ACK)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DsquantError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)  # clients queue in the backlog while the model loads
    return sock


def build_server(app, shutdown_timeout: float = 30.0, log_level: str = "warning"):
    """A uvicorn.Server for `app`: `.run(sockets=[sock])` serves until SIGTERM/SIGINT or `.should_exit`.

    Signals are handled only when run in the main thread (tests run servers in other threads).
    """
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                 timeout_graceful_shutdown=shutdown_timeout))


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


API_KEY_ENV = ("DSQUANT_API_KEY", "VLLM_API_KEY")  # the first one set wins


def _api_key(flag: str | None) -> str | None:
    """The key to require, refusing an empty one (click treats an empty DSQUANT_API_KEY as unset)."""
    from dsquant.runtime.server.guards import check_api_key

    for name in API_KEY_ENV:
        if flag is None and name in os.environ:
            flag = os.environ[name]
    return check_api_key(flag)


def _override_prompts(app, tokenizer_dir: str | None, template) -> None:
    """Point the app's prompt encoding at --tokenizer and --chat-template (set before serving)."""
    from dsquant.data.tokenizer import backend_tokenizer
    from dsquant.runtime.server.prompts import PromptEncoder

    s = app.state.server
    if tokenizer_dir is not None:
        s.tokenizer = backend_tokenizer(Path(tokenizer_dir))
        s.prompts = PromptEncoder(s.tokenizer, template, s.max_model_len, tokenizer_dir)
    elif template is not None:
        s.prompts.chat_template = template


@click.command(short_help="Serve a model over an OpenAI-compatible HTTP API.")
@click.argument("artifact", type=str)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option("--api-key", default=None, envvar=list(API_KEY_ENV),
              help="Require `Authorization: Bearer KEY` on /v1 routes (env DSQUANT_API_KEY or VLLM_API_KEY); an "
                   "empty key is refused.")
@click.option("--served-model-name", default=None, help="Model name in the API. Default: the artifact's folder name.")
@max_num_seqs_option()
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait beyond max-num-seqs running ones; more get 429.")
@click.option("--max-request-bytes", default=4 << 20, show_default=True,  # app.DEFAULT_MAX_REQUEST_BYTES
              type=click.IntRange(min=1024),
              help="Largest request body accepted; bigger ones get 413.")
@click.option("--allowed-hosts", default=None, metavar="H1,H2",
              help="Host header values to answer (names, addresses, '*.example.com', or '*' for any); others "
                   "get 400, which stops DNS rebinding. Default: the bound address (the loopback names when "
                   "bound to loopback; any when bound to 0.0.0.0 or ::).")
@click.option("--allowed-origins", default=None, metavar="O1,O2",
              help="Origins granted CORS, e.g. https://app.example ('*' for any). Default: none, and no CORS "
                   "headers are sent.")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds in-flight requests get to finish after SIGTERM.")
@click.option("--metrics-prefix", type=click.Choice(["dsquant", "vllm"]), default="dsquant", show_default=True,
              help="Prefix of /metrics' names: 'vllm' exposes vllm:* exactly as vLLM does, so vLLM's Grafana "
                   "dashboards work unmodified.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check the shards before loading: sha256 against dsquant.json (a dsquant artifact without "
                   "one is refused), else each shard's size against its header.")
@click.option("--disable-log-requests", is_flag=True,
              help="Do not log requests (by default one info line each: id, status, token counts, times; "
                   "never the prompt).")
@engine_options
def serve(artifact: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_num_seqs: int, max_queue: int, max_request_bytes: int, allowed_hosts: str | None,
          allowed_origins: str | None, shutdown_timeout: float, verify: bool, metrics_prefix: str,
          disable_log_requests: bool, **engine_opts) -> None:
    """Serve ARTIFACT (a checkpoint, an artifact or a bundled model) over an OpenAI-compatible API.

    Limits: at most --max-num-seqs running plus --max-queue waiting requests (more get 429 with
    Retry-After); bodies up to --max-request-bytes (413 beyond); prompts up to max_model_len tokens.
    POST bodies must be Content-Type: application/json (415 otherwise). The Host header must name
    this server (--allowed-hosts; 400 otherwise, against DNS rebinding); no CORS headers unless
    --allowed-origins.
    """
    api_key = _api_key(api_key)
    opts = pop_engine_options(engine_opts)
    missing = [m for m in ("fastapi", "prometheus_client", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise DsquantError(f"dsquant serve needs {', '.join(missing)}: pip install 'dsquant[serve]'")
    from dsquant.assets import resolve_model_dir
    from dsquant.runtime.engine.llm_engine import LLMEngine
    from dsquant.runtime.server.app import create_app

    from dsquant.runtime.server.guards import default_allowed_hosts

    model_dir = resolve_model_dir(artifact)
    template = None  # the tokenizer directory's own unless --chat-template or --tokenizer
    if opts["chat_template"] is not None or opts["tokenizer"] is not None:
        template = chat_template(opts["chat_template"], opts["tokenizer"] or model_dir)  # bad ones fail before loading
    sock = _bind(host, port)  # before loading, so a taken port fails fast
    hosts = _csv(allowed_hosts) or default_allowed_hosts(sock.getsockname()[0])
    engine = LLMEngine(model_dir, engine_config(opts, max_num_seqs=max_num_seqs, verify_checksums=verify))
    try:
        app = create_app(engine, model_name=served_model_name, api_key=api_key, max_queue=max_queue,
                         max_request_bytes=max_request_bytes, allowed_hosts=hosts,
                         allowed_origins=_csv(allowed_origins), metrics_prefix=metrics_prefix)
        _override_prompts(app, opts["tokenizer"], template)
        logger = logging.getLogger("dsquant.server")  # one info line per request (app.py)
        logger.setLevel(logging.WARNING if disable_log_requests else logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        bound_host, bound_port = sock.getsockname()[:2]
        name = app.state.server.model_name
        tp_size = engine.config.tensor_parallel_size
        tp = f", tensor parallel {tp_size}" if tp_size > 1 else ""
        stats = engine.stats()
        click.echo(f"dsquant serve: {name} on http://{bound_host}:{bound_port} (device {engine.device}{tp}, "
                   f"max_model_len {engine.max_model_len}, {engine.block_manager.num_blocks} KV blocks: "
                   f"{stats['kv_cache_tokens']} tokens, cache dtype {stats['kv_cache_dtype']})", err=True)
        build_server(app, shutdown_timeout).run(sockets=[sock])
    finally:
        engine.close()  # stops tensor-parallel workers
    click.echo("dsquant serve: stopped", err=True)
