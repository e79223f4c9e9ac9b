"""Helpers of metrics.py: series re-exposed under a second name, and vLLM-style bucket lists."""
from __future__ import annotations

from prometheus_client.metrics_core import Metric


class AliasCollector:
    """Re-exposes metrics under other names at scrape time: `[(metric, new name)]`, each metric a
    labelled parent (Counter / Gauge / Histogram). Nothing is observed twice; the samples are the
    source's, renamed (suffixes such as `_total`, `_bucket`, `_sum` kept)."""

    def __init__(self, pairs: list):
        self.pairs = pairs

    def collect(self):
        for source, name in self.pairs:
            for family in source.collect():
                out = Metric(name, family.documentation, family.type)
                out.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
                yield out


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def step_token_buckets(max_tokens: int) -> list[int]:
    """Tokens per engine step: 1, 8, 16, 32, ... below max_tokens, then max_tokens."""
    sizes = [1] + [8 << i for i in range(12)]
    return [b for b in sizes if b < max_tokens] + [max_tokens]
