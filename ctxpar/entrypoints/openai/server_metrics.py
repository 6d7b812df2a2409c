"""Prometheus metrics of the server, named like vLLM's (``ctxpar:`` for ``vllm:``).

Only the engine thread writes them (after each step or abort), so the
gauges are read from the engine's own bookkeeping without racing it; GET
/metrics renders the registry on the event loop.

The prefix cache's counters are rendered only for a request with the API key
(on a server with one): exact hit counts, read before and after a request of
one's own, say whether another client's prompt began the same way, an oracle
that needs no timing. A public scrape (--public-metrics) gets the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ctxpar.engine.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    EngineSnapshot,
    OutputEvent,
    SpecDecodeCounts,
)
from ctxpar.engine.metrics import (
    Counter as CounterValue,
)
from ctxpar.engine.rank_recovery import RankRecovery


class _CollectiveSeconds:
    """A counter read from the PCP group's own clocks (set by the engine thread)."""

    def __init__(self) -> None:
        self.seconds = {"data": 0.0, "control": 0.0}

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "ctxpar:pcp_collective_seconds", "Seconds rank 0 spent in PCP collectives", labels=["group"]
        )
        for group, s in self.seconds.items():
            c.add_metric([group], s)
        yield c


class _SpecDecode:
    """Speculative decoding's counters, read from the engine's totals (set by the engine thread)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.counts: SpecDecodeCounts | None = None

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for m in self.counts.metrics("ctxpar", self.labels) if self.counts is not None else []:
            assert isinstance(m, CounterValue)  # every spec_decode metric is a counter
            if m.name not in families:
                doc = "Speculative decoding (vLLM's spec_decode counters)"
                families[m.name] = CounterMetricFamily(m.name, doc, labels=list(m.labels))
            families[m.name].add_metric(list(m.labels.values()), m.value)
        yield from families.values()


class _PrefixCache:
    """The prefix cache's lookups in prompt tokens (vLLM's prefix_cache counters), read
    from the engine's totals (set by the engine thread)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.queries = self.hits = 0

    def collect(self) -> Iterator[Metric]:
        for name, value, doc in (
            ("ctxpar:prefix_cache_queries", self.queries, "Prompt tokens looked up in the prefix cache"),
            ("ctxpar:prefix_cache_hits", self.hits, "Prompt tokens found in the prefix cache"),
        ):
            c = CounterMetricFamily(name, doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            yield c


class _RankRecovery:
    """Lost PCP ranks, recoveries and the KV they restored, read from the engine's counts when scraped."""

    COUNTERS = (
        ("ctxpar:rank_failures", "rank_failures", "PCP ranks found lost (in a step, or while idle)"),
        ("ctxpar:rank_recoveries", "recoveries", "Lost PCP ranks respawned with the requests in flight restored"),
        ("ctxpar:recomputed_kv_tokens", "recomputed_tokens", "KV positions recomputed after a lost rank (DCP)"),
        ("ctxpar:copied_kv_tokens", "copied_tokens", "KV positions copied to a respawned rank (no DCP)"),
    )

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.source: Callable[[], RankRecovery | None] = lambda: None  # ServerState points it at the engine's

    def collect(self) -> Iterator[Metric]:
        recovery = self.source()
        for name, attr, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), getattr(recovery, attr) if recovery is not None else 0)
            yield c
        g = GaugeMetricFamily(
            "ctxpar:pcp_ranks",
            "PCP ranks serving now (fewer than configured after a rank lost for good)",
            labels=list(self.labels),
        )
        g.add_metric(list(self.labels.values()), recovery.pcp_ranks if recovery is not None else 0)
        yield g


class ServerMetrics:
    """The server's registry: a stat logger of the engine (ctxpar.engine.metrics.StatLogger)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(label), registry=r).labels(**label)

        self.running = gauge("ctxpar:num_requests_running", "Requests scheduled in the engine")
        self.waiting = gauge("ctxpar:num_requests_waiting", "Requests waiting for their first step")
        self.kv_usage = gauge("ctxpar:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.prompt_tokens = Counter(
            "ctxpar:prompt_tokens", "Prompt tokens of requests that got a first token", list(label), registry=r
        ).labels(**label)
        self.generation_tokens = Counter(
            "ctxpar:generation_tokens", "Generated tokens", list(label), registry=r
        ).labels(**label)
        self.success = Counter(
            "ctxpar:request_success", "Finished requests by finish reason", [*label, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "ctxpar:time_to_first_token_seconds",
            "Submission to first token",
            list(label),
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(**label)
        self.itl = Histogram(
            "ctxpar:inter_token_latency_seconds",
            "Time between a request's consecutive tokens",
            list(label),
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(**label)
        self.e2e = Histogram(
            "ctxpar:e2e_request_latency_seconds",
            "Submission to last token",
            list(label),
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(**label)
        self.collectives = _CollectiveSeconds()
        r.register(self.collectives)
        self.spec_decode = _SpecDecode(label)
        r.register(self.spec_decode)
        self.rank_recovery = _RankRecovery(label)
        r.register(self.rank_recovery)
        self.prefix_cache = _PrefixCache(label)
        self.private = CollectorRegistry()  # rendered for key holders only
        self.private.register(self.prefix_cache)
        self._label = label

    def record(self, event: OutputEvent) -> None:
        self.generation_tokens.inc(event.new_tokens)
        if event.ttft is not None:
            self.ttft.observe(event.ttft)
            self.prompt_tokens.inc(len(event.output.prompt_token_ids))
        if event.gap is not None:
            self.itl.observe(event.gap)
        if event.e2e is not None:
            self.e2e.observe(event.e2e)
            self.success.labels(**self._label, finished_reason=event.output.outputs[0].finish_reason).inc()

    def observe(self, snapshot: EngineSnapshot) -> None:
        self.running.set(snapshot.running)
        self.waiting.set(snapshot.waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        self.prefix_cache.queries, self.prefix_cache.hits = snapshot.prefix_cache_queries, snapshot.prefix_cache_hits
        if snapshot.collective_seconds:
            self.collectives.seconds = snapshot.collective_seconds
        self.spec_decode.counts = snapshot.spec_decode

    def render(self, private: bool) -> bytes:
        """The exposition text; ``private``: with the prefix cache's counters (the key was given)."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.private) if private else text
