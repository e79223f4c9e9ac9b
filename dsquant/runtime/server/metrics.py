"""Prometheus metrics with vLLM's names under the prefix `dsquant:`, in a registry per app.

Dashboards written for vLLM adapt by replacing `vllm:` with `dsquant:`. Every series carries a
`model_name` label, as vLLM's do. Counters are named without `_total`; prometheus_client adds
it on exposition (`dsquant:prompt_tokens_total`, `dsquant:prefix_cache_queries_total`). The
engine thread records; the HTTP thread only renders (prometheus_client is thread-safe).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "dsquant:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so histograms compare across servers
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        m = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, m, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, m, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last output token.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.",
                               REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that got a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Of those, tokens found in the prefix cache.")
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                m + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # exposed at 0 before the first request
        self._last_prefix = (0, 0)

    def baseline(self, stats: dict) -> None:
        """Count prefix-cache lookups from here on (an engine may have served requests before)."""
        self._last_prefix = (stats["prefix_cache_queries"], stats["prefix_cache_hits"])

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def engine_stats(self, stats: dict, extra_waiting: int = 0) -> None:
        """Gauges from LLMEngine.stats(); prefix-cache counters move by the engine's increments."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"] + extra_waiting)
        self.kv_usage.set(stats["kv_cache_usage"])
        queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        last_q, last_h = self._last_prefix
        if queries >= last_q and hits >= last_h:
            self.prefix_queries.inc(queries - last_q)
            self.prefix_hits.inc(hits - last_h)
        self._last_prefix = (queries, hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
