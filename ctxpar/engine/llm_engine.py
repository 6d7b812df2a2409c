"""LLMEngine: vLLM's synchronous engine API over ctxpar's Engine.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("0", "Hello, my name is", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...

It adds to the Engine what a caller of vLLM's expects: string and prompt-dict
inputs (tokenized here), each request's ``output_kind``, statistics
(``get_metrics``) and vLLM's method names. The ranks live as long as the
LLMEngine does: ``close()``, or its collection, stops them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ctxpar.config import EngineConfig
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.engine.engine import Engine
from ctxpar.engine.input_processor import EngineRequest
from ctxpar.engine.metrics import EngineSnapshot, EngineStats, EventTracker, Metric, StatLogger
from ctxpar.engine.output_kinds import OutputShaper
from ctxpar.engine.vllm_args import load_tokenizer, refuse_lora
from ctxpar.errors import CtxparError
from ctxpar.inputs import PromptType
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class ModelConfig:
    """What vLLM's ``get_model_config()`` callers read."""

    model: str
    max_model_len: int
    dtype: str
    hf_config: Any

    def get_vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


class LLMEngine:
    """vLLM's synchronous engine (see the module docstring); stat_loggers get every
    output's event and the engine's gauges, besides its own ``stats``."""

    def __init__(self, engine_args: EngineArgs, stat_loggers: Iterable[StatLogger] = ()) -> None:
        self.engine_args = engine_args
        self.config: EngineConfig = engine_args.create_engine_config()  # validated before any model loads
        own_tokenizer = (
            load_tokenizer(engine_args.tokenizer, engine_args.trust_remote_code)
            if engine_args.tokenizer is not None
            else None
        )
        self.engine: Engine | None = Engine(self.config)
        if engine_args.skip_tokenizer_init:
            self.engine.tokenizer = None
        elif own_tokenizer is not None:
            self.set_tokenizer(own_tokenizer)
        self.stats = EngineStats({"model_name": self.engine.loaded.name})
        self.rank_recovery = self.engine.recovery  # kept after close: /health and /metrics read it
        self.stat_loggers: list[StatLogger] = [self.stats, *stat_loggers]
        self._events = EventTracker()
        self._shaper = OutputShaper()
        self._observe()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, stat_loggers: Iterable[StatLogger] = ()) -> LLMEngine:
        return cls(engine_args, stat_loggers)

    @property
    def _engine(self) -> Engine:
        if self.engine is None:
            raise CtxparError("this engine has been closed")
        return self.engine

    # -- requests ---------------------------------------------------------------

    def process_inputs(self, prompt: PromptType, params: SamplingParams | None) -> EngineRequest:
        """Tokenize and check one prompt without queuing it (the engine's InputProcessor)."""
        return self._engine.processor.process_inputs(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request: a string, a TextPrompt or a TokensPrompt.

        arrival_time: when it arrived (``time.time()``; default now): its TTFT counts from there.
        priority: only 0 (requests are scheduled first come, first served).
        """
        if not isinstance(request_id, str):
            raise CtxparError(f"request_id must be a string, got {type(request_id).__name__}")
        self.check_options(lora_request, priority, tokenization_kwargs)
        self.add_processed_request(request_id, self.process_inputs(prompt, params), arrival_time)

    @staticmethod
    def check_options(lora_request: Any = None, priority: int = 0, tokenization_kwargs: Any = None) -> None:
        """vLLM's request options that ctxpar has no use for: refused unless neutral."""
        refuse_lora(lora_request)
        if priority != 0:
            raise CtxparError(
                f"priority={priority!r} is not supported: requests are scheduled first come, first served"
            )
        if tokenization_kwargs:
            raise CtxparError("tokenization_kwargs are not supported; tokenize the prompt and pass prompt_token_ids")

    def add_processed_request(
        self,
        request_id: str | None,
        request: EngineRequest,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> str:
        """Queue a request that ``process_inputs`` made; returns its id (a new one if None).
        output_kind: instead of its params' output_kind (LLM reads every output whole)."""
        arrival = None
        if arrival_time is not None:  # wall clock -> the engine's monotonic clock
            arrival = time.perf_counter() - max(0.0, time.time() - arrival_time)
        rid = self._engine.add_request(request, request_id=request_id, arrival_time=arrival)
        self._shaper.add(rid, output_kind if output_kind is not None else request.params.output_kind)
        return rid

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed now."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._engine.abort(rid)
            self._shaper.forget(rid)
            self._events.forget(rid)
        self._observe()

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def check_health(self) -> None:
        """Raise RankFailure if a rank is known to be lost (as vLLM's, between steps)."""
        self._engine.check_health()

    def get_num_unfinished_requests(self) -> int:
        return len(self._engine.groups)

    # -- the loop -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs due by each request's output_kind
        (a failed step raises and leaves every request as it was)."""
        outs = self._engine.step()
        now = time.perf_counter()
        shaped = []
        for out in outs:
            event = self._events.event(out, now)
            for logger in self.stat_loggers:
                logger.record(event)
            s = self._shaper.shape(out)
            if s is not None:
                shaped.append(s)
        self._observe()
        return shaped

    def _observe(self) -> None:
        snapshot = EngineSnapshot.of(self._engine)
        for logger in self.stat_loggers:
            logger.observe(snapshot)

    # -- what vLLM callers read -------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use this tokenizer from now on; its EOS ends generation too (as vLLM's)."""
        self._engine.tokenizer = tokenizer
        if isinstance(getattr(tokenizer, "eos_token_id", None), int):
            self._engine.eos_token_ids.add(tokenizer.eos_token_id)

    def get_model_config(self) -> ModelConfig:
        e = self._engine
        return ModelConfig(e.loaded.name, e.max_model_len, self.config.dtype, e.loaded.hf_config)

    def get_metrics(self) -> list[Metric]:
        return self.stats.metrics(self.config)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no running request holds; True if the
        cache is now empty (False while requests still hold cached blocks)."""
        return self._engine.block_manager.reset_prefix_cache()

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks; the engine cannot be used afterwards. Idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
