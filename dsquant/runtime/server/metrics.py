"""Prometheus metrics with vLLM's names, under the prefix `dsquant:` or `vllm:`, in a registry per app.

`--metrics-prefix vllm` makes /metrics read as vLLM's own, so vLLM's Grafana dashboards work
unmodified: the same names, buckets and labels (`model_name`, and `engine="0"` as vLLM v1 adds).
With the default `dsquant` prefix the series carry `model_name` only, and dashboards written for
vLLM adapt by replacing `vllm:` with `dsquant:` (deploy/grafana/dsquant.json is dsquant's own).

Counters are named without `_total`; prometheus_client adds it on exposition. Older vLLM names
that dashboards still query are aliases renamed at scrape time (metrics_alias.py), never a second
observation; the two gauges of vLLM's swap space (dsquant has none) are exposed at 0. Process and
platform collectors add prometheus_client's `process_*` / `python_*` series, as vLLM's default
registry has. Recording stays cheap: per engine step a few gauges and one histogram; per request
at its end, a handful of observations; per output, what existed before (TTFT / inter-token).
The engine thread records; the HTTP thread only renders (prometheus_client is thread-safe).
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dsquant.runtime.server.metrics_alias import AliasCollector, buckets_1_2_5, step_token_buckets

PREFIXES = ("dsquant", "vllm")
PREFIX = "dsquant:"  # the default
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so histograms compare across servers
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


def cache_info(engine) -> dict[str, str]:
    """cache_config_info's labels (vLLM's CacheConfig fields that dsquant has) from an LLMEngine."""
    c = engine.config
    runner = getattr(engine, "runner", None)
    if runner is not None:  # the cache's own dtype: the model's under auto, fp8_e4m3 under fp8
        dtype = runner.kv_spec.label
    else:
        dtype = str(c.dtype or "auto").removeprefix("torch.")
    return {"block_size": str(c.block_size), "cache_dtype": dtype,
            "enable_prefix_caching": str(bool(c.enable_prefix_caching)),
            "gpu_memory_utilization": str(c.gpu_memory_utilization),
            "num_gpu_blocks": str(engine.block_manager.num_blocks), "num_cpu_blocks": "0"}


class ServerMetrics:
    """`engine` (optional, an LLMEngine) sizes the token histograms (max_model_len,
    max_num_batched_tokens) and fills cache_config_info."""

    def __init__(self, model_name: str, prefix: str = "dsquant", engine=None):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r}: expected one of {', '.join(PREFIXES)}")
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name, self.prefix = model_name, prefix
        p = prefix + ":"
        names = ["model_name"] + (["engine"] if prefix == "vllm" else [])
        values = [model_name] + (["0"] if prefix == "vllm" else [])
        max_len = getattr(engine, "max_model_len", None) or 1 << 17
        step_cap = engine.config.max_num_batched_tokens if engine is not None else 8192
        parents = {}

        def make(kind, name, doc, **kw):
            parents[name] = kind(p + name, doc, names, registry=r, **kw)
            return parents[name].labels(*values)

        def hist(name, doc, buckets):
            return make(Histogram, name, doc, buckets=buckets)

        # per request, observed at its end (queue time when first scheduled, TTFT at its first token)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token.",
                         TTFT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last output token.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.",
                               REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Time from first being scheduled to the first output token.", REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "Time from the first to the last output token.",
                                REQUEST_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Time from first being scheduled to the last output token.", REQUEST_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per request: (e2e latency - TTFT) / (output tokens - 1); 0 for one token.",
                                 ITL_BUCKETS)
        self.prompt_tokens_hist = hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                       buckets_1_2_5(max_len))
        self.generation_tokens_hist = hist("request_generation_tokens", "Output tokens per finished request.",
                                           buckets_1_2_5(max_len))
        self.max_generation_tokens = hist("request_max_num_generation_tokens",
                                          "Most output tokens of a request's sequences (one per request).",
                                          buckets_1_2_5(max_len))
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.",
                                      buckets_1_2_5(max_len))
        # per output and per step
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens scheduled per engine step.",
                                     step_token_buckets(step_cap))
        self.running = make(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        make(Gauge, "num_requests_swapped", "Requests swapped to CPU memory: always 0 (dsquant recomputes).")
        make(Gauge, "cpu_cache_usage_perc", "CPU KV-cache usage: always 0 (dsquant has no CPU swap space).")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of the requests that got a first token.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Of those, tokens found in the prefix cache.")
        self.preemptions = make(Counter, "num_preemptions", "Preemptions (a running request's KV blocks freed, "
                                "to be recomputed).")
        self._success = Counter(p + "request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._success.labels(*values, reason)  # exposed at 0 before the first request
        self._values = values
        if engine is not None:
            info = cache_info(engine)
            Gauge(p + "cache_config_info", "Information of the KV-cache configuration.", names + list(info),
                  registry=r).labels(*values, *info.values()).set(1)
            bm = engine.block_manager
            Gauge(p + "kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block size), by cache dtype.",
                  names + ["cache_dtype"], registry=r).labels(*values, info["cache_dtype"]).set(
                      bm.num_blocks * bm.block_size)
        # names older vLLM releases (and their dashboards) use for the same series
        r.register(AliasCollector([(parents["kv_cache_usage_perc"], p + "gpu_cache_usage_perc"),
                                   (parents["inter_token_latency_seconds"], p + "time_per_output_token_seconds"),
                                   (parents["prefix_cache_queries"], p + "gpu_prefix_cache_queries"),
                                   (parents["prefix_cache_hits"], p + "gpu_prefix_cache_hits")]))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._last = (0, 0, 0)  # the engine's prefix-cache queries, hits and preemptions so far

    def baseline(self, stats: dict) -> None:
        """Count from here on (an engine may have served requests before)."""
        self._last = (stats["prefix_cache_queries"], stats["prefix_cache_hits"], stats.get("num_preemptions", 0))

    def request_finished(self, reason: str) -> None:
        self._success.labels(*self._values, reason).inc()

    def request_completed(self, tr, now: float, num_output_tokens: int, reason: str) -> None:
        """A request that got its last token at `now`. `tr`: arrival, scheduled_at, first_token_time,
        num_prompt_tokens, max_tokens (the engine loop's record of the request)."""
        scheduled = tr.scheduled_at or tr.arrival
        first = tr.first_token_time or now
        self.e2e.observe(now - tr.arrival)
        self.prefill_time.observe(max(0.0, first - scheduled))
        self.decode_time.observe(now - first)
        self.inference_time.observe(max(0.0, now - scheduled))
        self.request_tpot.observe((now - first) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0)
        self.prompt_tokens_hist.observe(tr.num_prompt_tokens)
        self.generation_tokens_hist.observe(num_output_tokens)
        self.max_generation_tokens.observe(num_output_tokens)
        if tr.max_tokens:
            self.params_max_tokens.observe(tr.max_tokens)
        self.request_finished(reason)

    def step_tokens(self, n: int) -> None:
        if n > 0:
            self.iteration_tokens.observe(n)

    def engine_stats(self, stats: dict, extra_waiting: int = 0) -> None:
        """Gauges from LLMEngine.stats(); the counters move by the engine's increments."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"] + extra_waiting)
        self.kv_usage.set(stats["kv_cache_usage"])
        now = (stats["prefix_cache_queries"], stats["prefix_cache_hits"], stats.get("num_preemptions", 0))
        if all(a >= b for a, b in zip(now, self._last)):
            self.prefix_queries.inc(now[0] - self._last[0])
            self.prefix_hits.inc(now[1] - self._last[1])
            self.preemptions.inc(now[2] - self._last[2])
        self._last = now

    def render(self) -> bytes:
        return generate_latest(self.registry)
