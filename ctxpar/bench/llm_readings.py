"""What the benchmarks read off an open ``LLM`` through its public API (vLLM's
``llm.llm_engine.get_model_config()`` and ``LLM.get_metrics()``) rather than
the engine's attributes: the model's name and vocabulary, rank 0's seconds
in the PCP group's collectives, and a finished request's time to first token.

The metrics are those of the last ``LLM.generate`` (or ``LLMEngine.step``): a
benchmark that steps ctxpar's Engine itself reads its counters there instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ctxpar.outputs import RequestOutput


def model_name(llm: Any) -> str:
    return str(llm.llm_engine.get_model_config().model)


def vocab_size(llm: Any) -> int:
    return int(llm.llm_engine.get_model_config().get_vocab_size())


def collective_seconds(llm: Any, group: str = "data") -> float:
    """Rank 0's seconds so far in the PCP group's ``group`` collectives: "data" (the KV
    all-gathers and hidden-state gathers) or "control" (the plans' broadcasts); 0 with
    one rank."""
    for m in llm.get_metrics():
        if m.name == "ctxpar:pcp_collective_seconds" and m.labels.get("group") == group:
            return float(m.value)
    return 0.0


def first_token_seconds(out: RequestOutput) -> float:
    """The request's seconds to its first token; a request the benchmark ran has one."""
    seconds = out.ttft
    if seconds is None:
        raise RuntimeError(f"request {out.request_id} produced no token")
    return seconds
