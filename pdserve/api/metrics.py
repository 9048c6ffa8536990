"""Prometheus metrics of one API app, in the app's own registry (never the process-global one,
so several apps in one process, as in tests, do not collide).

Latencies and outcomes are recorded by the HTTP layer; everything the backend knows (queue
depths, transfer bytes and seconds by state kind, transfer failures, the prefill instances'
prefix caches) is read from
`backend.stats()` at scrape time, so it is never stale and the backend needs no Prometheus code.
"""
from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# ok: finished (stop or length); error: failed or timed out after admission; cancelled: the client
# went away; rejected: overload or backend unavailable (429/503); invalid: bad input (400).
OUTCOMES = ("ok", "error", "cancelled", "rejected", "invalid")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiMetrics:
    def __init__(self, backend) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Request arrival to its first output token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.generated = Counter("pdserve_generated_tokens", "Output tokens generated", registry=r)
        self.prompt = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests",
                              registry=r)
        for outcome in OUTCOMES:  # export zeros, so rates exist before the first event
            self.requests.labels(outcome)
        r.register(_BackendStats(backend))

    def track(self) -> "RequestTrack":
        return RequestTrack(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTrack:
    """The timings and outcome of one request; `done` counts it exactly once."""

    def __init__(self, metrics: ApiMetrics):
        self._m = metrics
        self._start = time.perf_counter()
        self._last: float | None = None
        self._done = False

    def token(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self._start)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now
        self._m.generated.inc()

    def prompt(self, num_tokens: int) -> None:
        self._m.prompt.inc(num_tokens)

    def done(self, outcome: str) -> None:
        if not self._done:
            self._done = True
            self._m.requests.labels(outcome).inc()


_TRANSFER = re.compile(r"transfer_(bytes|seconds)_(\w+)")
_RESTARTS = re.compile(r"restarts_(\w+)")
# the prefill instances' prefix caches (`Router.stats`): running totals, then what they hold now
_PREFIX_COUNTERS = {
    "prefix_hits": "Prompts whose first blocks were found in a prefill prefix cache",
    "prefix_misses": "Prompts looked up in a prefill prefix cache and not found",
    "prefix_tokens_saved": "Prompt tokens not prefilled because a prefix cache held them",
    "prefix_evictions": "Prefix cache entries (blocks) evicted",
}
_PREFIX_GAUGES = {
    "prefix_hit_rate": "Prefix cache hits / lookups since start",
    "prefix_cached_tokens": "Prompt tokens the prefix caches hold (full blocks)",
    "prefix_entries": "Blocks the prefix caches hold",
    "prefix_checkpoints": "KDA checkpoints the prefix caches hold",
    "prefix_bytes": "State bytes the prefix caches hold (latent pages and checkpoints)",
}


class _BackendStats:
    """Exports `backend.stats()` at every scrape: `transfer_bytes_<kind>` and
    `transfer_seconds_<kind>` as counters labelled by kind, `transfer_failures` as a counter,
    `restarts_<kind>` (instances rebuilt after a rank died) as the counter
    `pdserve_instance_restarts` labelled by kind (they are running totals), the prefix caches'
    `prefix_<name>` as `pdserve_prefix_cache_<name>` (hits, misses, tokens saved and evictions
    counters, the rest gauges), every other key as a gauge `pdserve_backend_<key>`."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def collect(self):
        stats = self._backend.stats()
        transfer = {k: CounterMetricFamily(f"pdserve_transfer_{k}",
                                           f"State transfer {k} by state kind", labels=["kind"])
                    for k in ("bytes", "seconds")}
        restarts = CounterMetricFamily("pdserve_instance_restarts",
                                       "Instances rebuilt after a rank died, by kind",
                                       labels=["kind"])
        for key, value in sorted(stats.items()):
            if m := _TRANSFER.fullmatch(key):
                transfer[m[1]].add_metric([m[2]], value)
            elif m := _RESTARTS.fullmatch(key):
                restarts.add_metric([m[1]], value)
            elif key in _PREFIX_COUNTERS:
                yield CounterMetricFamily(f"pdserve_prefix_cache_{key[7:]}",
                                          _PREFIX_COUNTERS[key], value=value)
            elif key in _PREFIX_GAUGES:
                yield GaugeMetricFamily(f"pdserve_prefix_cache_{key[7:]}", _PREFIX_GAUGES[key],
                                        value=value)
            elif key == "transfer_failures":
                yield CounterMetricFamily("pdserve_transfer_failures", "Failed state transfers",
                                          value=value)
            else:
                name = "pdserve_backend_" + re.sub(r"\W", "_", key)
                yield GaugeMetricFamily(name, f"backend stats()[{key!r}]", value=value)
        for family in (*transfer.values(), restarts):
            if family.samples:
                yield family
