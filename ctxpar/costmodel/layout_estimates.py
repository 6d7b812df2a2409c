"""Every feasible context-parallel layout of one request shape, its predicted
TTFT, decode step and memory per rank, and the one to pick.

Layouts: P PCP ranks with D in {1, P} (ctxpar's rule: the DCP group is the PCP
group or nothing). P = 1 has no communication (algorithm "none"); with D = 1
the context is on every rank, so the prefill moves only the new tokens' KV
(pass-KV or gather); with D = P it may pass the queries instead (pass-Q).

A profile of ranks that share one host (one with a ``lead``, as `ctxpar
calibrate --link shm` measures) times P > 1 decode steps at D = 1 at the lead's
rates: the engine runs those steps on rank 0 with every rank's threads.

Memory per rank = weights + B * ceil(context / D) * KV bytes per token; it fits
when it is at most ``usable_memory_fraction`` of the rank's memory
(activations and workspace are not modelled). The recommendation is the layout
that fits with the least TTFT + output_tokens * decode step (the time of a
whole answer), fewer ranks first on a tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ctxpar.costmodel.hardware import HardwareProfile
from ctxpar.costmodel.shapes import ModelShape
from ctxpar.costmodel.timing import Breakdown, decode_time, prefill_time
from ctxpar.errors import CtxparError

GIB = 1 << 30
DEFAULT_PCP = (1, 2, 4, 8, 16)
DEFAULT_OUTPUT_TOKENS = 128
MAX_RANKS = 4096


@dataclass(frozen=True)
class Estimate:
    pcp: int
    dcp: int
    algorithm: str  # "none" (P = 1), "pass-KV", "pass-Q" or "gather"
    ttft: Breakdown
    decode: Breakdown
    weights_bytes: float  # per rank
    kv_bytes: float  # per rank
    fits: bool
    recommended: bool = False

    @property
    def ttft_s(self) -> float:
        return self.ttft.total_s

    @property
    def decode_ms(self) -> float:
        return 1e3 * self.decode.total_s

    @property
    def memory_gib_per_rank(self) -> float:
        return (self.weights_bytes + self.kv_bytes) / GIB

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``ctxpar estimate --json``."""
        parts = ("compute_s", "memory_s", "tp_comm_s", "comm_s", "overhead_s")
        return {
            "pcp": self.pcp,
            "dcp": self.dcp,
            "algorithm": self.algorithm,
            "ttft_s": self.ttft_s,
            "decode_ms": self.decode_ms,
            "memory_gib_per_rank": self.memory_gib_per_rank,
            "weights_gib_per_rank": self.weights_bytes / GIB,
            "kv_gib_per_rank": self.kv_bytes / GIB,
            "fits": self.fits,
            "recommended": self.recommended,
            "ttft_breakdown": {p: getattr(self.ttft, p) for p in parts},
            "decode_breakdown_ms": {p.replace("_s", "_ms"): 1e3 * getattr(self.decode, p) for p in parts},
        }


def _check_count(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise CtxparError(f"{name} must be an integer {limit}, got {value!r}")


def layouts(pcp: list[int], dcp: list[int] | None) -> list[tuple[int, int, str]]:
    """(P, D, algorithm) for every P in ``pcp`` and D in ``dcp`` (default: 1 and P) with D in {1, P}."""
    out: list[tuple[int, int, str]] = []
    for p in sorted(set(pcp)):
        for d in sorted(set(dcp) if dcp is not None else {1, p}):
            if d != 1 and d != p:
                continue
            if p == 1:
                out.append((1, 1, "none"))
            else:
                algorithms = ("pass-KV", "pass-Q", "gather") if d > 1 else ("pass-KV", "gather")
                out.extend((p, d, a) for a in algorithms)
    if not out:
        raise CtxparError(f"no feasible layout: DCP size must be 1 or equal to the PCP size (pcp {pcp}, dcp {dcp})")
    return out


def estimate(
    model: ModelShape,
    hardware: HardwareProfile,
    context: int,
    cached: int = 0,
    batch: int = 1,
    pcp: list[int] | None = None,
    dcp: list[int] | None = None,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
) -> list[Estimate]:
    """Predictions for every feasible layout, one marked recommended (none if nothing fits).

    context: the prompt's total tokens, cached ones included; cached: tokens already
    in the KV cache (only context - cached are prefilled); the decode step is at the
    full context.
    """
    _check_count("context", context, 1)
    _check_count("cached", cached, 0, context - 1)  # at least one token is computed to sample from
    _check_count("batch", batch, 1)
    _check_count("output_tokens", output_tokens, 0)
    pcp = list(DEFAULT_PCP) if pcp is None else pcp
    for p in pcp + (dcp or []):
        _check_count("a PCP / DCP size", p, 1, MAX_RANKS)
    hardware = hardware.for_model(model)  # its weights read at the rate of its layers' width
    weights = model.total_params * hardware.weight_bytes
    kv_token = hardware.kv_token_bytes(model) * model.num_layers
    results = []
    for p, d, algorithm in layouts(pcp, dcp):
        kv = batch * math.ceil(context / d) * kv_token
        results.append(
            Estimate(
                pcp=p,
                dcp=d,
                algorithm=algorithm,
                ttft=prefill_time(model, hardware, context - cached, cached, batch, p, d, algorithm),
                # Ranks on one host lead a step of decodes at D = 1 (the profile's lead).
                decode=decode_time(model, hardware.led(p > 1 and d == 1), context, batch, d),
                weights_bytes=weights,
                kv_bytes=kv,
                fits=weights + kv <= hardware.usable_memory_fraction * hardware.memory_bytes,
            )
        )
    fitting = [e for e in results if e.fits]
    if fitting:
        best = min(fitting, key=lambda e: (e.ttft_s + output_tokens * e.decode.total_s, e.pcp, e.dcp))
        results = [replace(e, recommended=True) if e is best else e for e in results]
    return results
