"""Prometheus metrics of the server, named like vLLM's (``ctxpar:`` for ``vllm:``).

Only the engine thread writes them (after each step, abort or token), so the
gauges are read from the engine's own bookkeeping without racing it; GET
/metrics renders the registry on the event loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ctxpar.outputs import RequestOutput

# vLLM's buckets: TTFT from 1 ms to 160 s, inter-token latency from 10 ms to 80 s.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _CollectiveSeconds:
    """A counter read from the PCP group's own clocks (set by the engine thread)."""

    def __init__(self) -> None:
        self.seconds = {"data": 0.0, "control": 0.0}

    def collect(self):
        c = CounterMetricFamily(
            "ctxpar:pcp_collective_seconds", "Seconds rank 0 spent in PCP collectives", labels=["group"]
        )
        for group, s in self.seconds.items():
            c.add_metric([group], s)
        yield c


class ServerMetrics:
    """The server's registry and the hooks the engine loop calls."""

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
        self._label = label

    def first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc()

    def next_token(self, gap: float) -> None:
        self.itl.observe(gap)
        self.generation_tokens.inc()

    def finished(self, out: RequestOutput, e2e: float) -> None:
        self.e2e.observe(e2e)
        self.success.labels(**self._label, finished_reason=out.outputs[0].finish_reason).inc()

    def observe_engine(self, engine) -> None:
        """Gauges from the engine's state (engine thread only)."""
        sched, blocks = engine.scheduler, engine.block_manager
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(1.0 - blocks.num_free_blocks / blocks.num_blocks)
        group = getattr(engine.executor, "group", None)  # a MultiRankExecutor's PCPGroup; None with one rank
        if group is not None:
            self.collectives.seconds = {"data": group.comm_seconds, "control": group.control_seconds}

    def render(self) -> bytes:
        return generate_latest(self.registry)
