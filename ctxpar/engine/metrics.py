"""Engine statistics, and vLLM V1's metrics reader types (``vllm.v1.metrics.reader``).

Every output the engine hands out becomes an ``OutputEvent`` (its new tokens,
and its first-token, inter-token and end-to-end times); stat loggers take the
events and the engine's gauges after each step. ``EngineStats`` is the one
every LLMEngine keeps (``LLM.get_metrics()``); the server's Prometheus
registry is another (ctxpar/entrypoints/openai/server_metrics.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ctxpar.outputs import RequestOutput

if TYPE_CHECKING:
    from ctxpar.config import EngineConfig
    from ctxpar.engine.engine import Engine
    from ctxpar.engine.spec_decode import SpecDecodeStats

# vLLM's buckets: TTFT from 1 ms to 160 s, inter-token latency from 10 ms to 80 s.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# fmt: on


# -- vLLM's reader types -----------------------------------------------------------


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> observations at or below it


# -- events and loggers --------------------------------------------------------------


@dataclass(frozen=True)
class OutputEvent:
    """One output handed out, as the stat loggers see it."""

    output: RequestOutput  # cumulative
    new_tokens: int  # tokens generated since the request's previous output, all samples
    ttft: float | None  # seconds from arrival to the first token, on the request's first output
    gap: float | None  # seconds since the request's previous output (inter-token latency)
    e2e: float | None  # seconds from arrival to the end, on its last output


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's totals (vLLM's spec_decode counters)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # [i]: drafts at position i accepted

    @classmethod
    def of(cls, stats: SpecDecodeStats) -> SpecDecodeCounts:
        return cls(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, tuple(stats.accepted_per_pos))

    def metrics(self, prefix: str, labels: dict[str, str]) -> list[Metric]:
        """The counters, named ``{prefix}:spec_decode_*`` as vLLM's."""
        return [
            Counter(f"{prefix}:spec_decode_num_drafts", labels, self.num_drafts),
            Counter(f"{prefix}:spec_decode_num_draft_tokens", labels, self.num_draft_tokens),
            Counter(f"{prefix}:spec_decode_num_accepted_tokens", labels, self.num_accepted_tokens),
            *(
                Counter(f"{prefix}:spec_decode_num_accepted_tokens_per_pos", {**labels, "position": str(i)}, n)
                for i, n in enumerate(self.accepted_per_pos)
            ),
        ]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and running totals, read on the engine's thread after a
    step or an abort (so readers on other threads never touch its state)."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use (1 = full)
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    collectives: int | None  # data collectives of the PCP group; None with one rank
    collective_seconds: dict[str, float]  # rank 0's seconds in them, "data" and "control"; {} with one rank
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's totals; None when it is off

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        sched, blocks = engine.scheduler, engine.block_manager
        group = getattr(engine.executor, "group", None)  # a MultiRankExecutor's PCPGroup; None with one rank
        return cls(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
            prefix_cache_queries=sched.prefix_cache_stats.queries,
            prefix_cache_hits=sched.prefix_cache_stats.hits,
            preemptions=sched.num_preemptions,
            steps=engine.num_steps,
            collectives=sum(group.num_collectives.values()) if group is not None else None,
            collective_seconds=(
                {"data": group.comm_seconds, "control": group.control_seconds} if group is not None else {}
            ),
            spec_decode=SpecDecodeCounts.of(engine.spec.stats) if engine.spec is not None else None,
        )


class StatLogger(Protocol):
    def record(self, event: OutputEvent) -> None: ...

    def observe(self, snapshot: EngineSnapshot) -> None:
        """The engine's state after a step or an abort."""
        ...


class EventTracker:
    """Turns cumulative outputs into OutputEvents (per request: tokens seen, last output time)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}

    def event(self, out: RequestOutput, now: float) -> OutputEvent:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        before = self._seen.pop(out.request_id, None)
        m = out.metrics
        arrival = m.arrival_time if m is not None else now
        if not out.finished:
            self._seen[out.request_id] = (tokens, now)
        return OutputEvent(
            output=out,
            new_tokens=tokens - (before[0] if before else 0),
            ttft=(m.first_token_time or now) - arrival if before is None and m is not None else None,
            gap=now - before[1] if before is not None else None,
            e2e=now - arrival if out.finished else None,
        )

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative, running = {}, 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], counts):
            running += c
            cumulative[bound] = running
        return Histogram(name, labels, count=running, sum=self.total, buckets=cumulative)


class EngineStats:
    """The counters, gauges and histograms of ``get_metrics()``, under vLLM's names
    (``vllm:``) and ctxpar's own (``ctxpar:``) for context parallelism."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.snapshot: EngineSnapshot | None = None  # the latest; LLMEngine observes before any step

    def record(self, event: OutputEvent) -> None:
        self.generation_tokens += event.new_tokens
        if event.ttft is not None:
            self.ttft.observe(event.ttft)
            self.prompt_tokens += len(event.output.prompt_token_ids)
        if event.gap is not None:
            self.itl.observe(event.gap)
        if event.e2e is not None:
            self.e2e.observe(event.e2e)
            reason = event.output.outputs[0].finish_reason or "abort"
            self.success[reason] = self.success.get(reason, 0) + 1

    def observe(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def metrics(self, config: EngineConfig) -> list[Metric]:
        snap, lab = self.snapshot, self.labels
        assert snap is not None, "LLMEngine observes the engine once it is built"
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", lab, self.prompt_tokens),
            Counter("vllm:generation_tokens", lab, self.generation_tokens),
            Counter("vllm:prefix_cache_queries", lab, snap.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", lab, snap.prefix_cache_hits),
            Counter("vllm:num_preemptions", lab, snap.preemptions),
            Counter("ctxpar:engine_steps", lab, snap.steps),
            *(Counter("vllm:request_success", {**lab, "finished_reason": r}, n) for r, n in self.success.items()),
            Gauge("vllm:num_requests_running", lab, snap.running),
            Gauge("vllm:num_requests_waiting", lab, snap.waiting),
            Gauge("vllm:kv_cache_usage_perc", lab, snap.kv_cache_usage),
            Gauge("ctxpar:pcp_size", lab, config.pcp_size),
            Gauge("ctxpar:dcp_size", lab, config.dcp_size),
            *([Counter("ctxpar:pcp_collectives", lab, snap.collectives)] if snap.collectives is not None else []),
            *(
                Gauge("ctxpar:pcp_collective_seconds", {**lab, "group": g}, s)
                for g, s in snap.collective_seconds.items()
            ),
            self.ttft.metric("vllm:time_to_first_token_seconds", lab),
            self.itl.metric("vllm:inter_token_latency_seconds", lab),
            self.e2e.metric("vllm:e2e_request_latency_seconds", lab),
            *(snap.spec_decode.metrics("vllm", lab) if snap.spec_decode is not None else []),
        ]
        return out
