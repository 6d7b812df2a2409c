"""The offline API's requests on the LLMEngine: queued, stepped until the ones a
call waits for finish (with a progress bar), aborted when it stops waiting.

Every call of the LLM (a batch of ``generate``, an open ``stream``) steps the
same engine, so one call's step may produce another's outputs: those are kept
in a mailbox for their owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ctxpar.errors import CtxparError
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import RequestOutputKind

if TYPE_CHECKING:  # imported when an LLM is made: `import ctxpar` (and `ctxpar --help`) stays free of torch
    from ctxpar.engine.engine import Engine
    from ctxpar.engine.input_processor import EngineRequest
    from ctxpar.engine.llm_engine import LLMEngine

# use_tqdm: True for tqdm's bar, False for none, or a callable that makes the bar
# (e.g. functools.partial(tqdm, leave=False)); called with tqdm's keyword arguments.
UseTqdm = bool | Callable[..., Any]


def check_tqdm(use_tqdm: Any) -> None:
    """A CtxparError unless ``use_tqdm`` is a bool or a bar maker."""
    if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
        raise CtxparError(f"use_tqdm must be True, False or a callable making a tqdm bar, got {use_tqdm!r}")


def progress_bar(use_tqdm: UseTqdm, *args: Any, **kwargs: Any) -> Any:
    """tqdm(*args, **kwargs), or the caller's own bar maker (use_tqdm as a callable, as vLLM)."""
    if callable(use_tqdm):
        return use_tqdm(*args, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(*args, **kwargs)


class RequestLoop:
    """An LLM's requests on its LLMEngine, which the loop holds until ``close``."""

    def __init__(self, llm_engine: LLMEngine) -> None:
        self.llm_engine: LLMEngine | None = llm_engine
        self.mailbox: dict[str, RequestOutput] = {}  # latest output of requests another loop stepped

    def require_llm_engine(self) -> LLMEngine:
        """The LLMEngine; a CtxparError once closed."""
        if self.llm_engine is None:
            raise CtxparError("this LLM has been closed")
        return self.llm_engine

    def require_engine(self) -> Engine:
        """ctxpar's Engine under the LLMEngine; a CtxparError once either is closed."""
        engine = self.llm_engine.engine if self.llm_engine is not None else None
        if engine is None:
            raise CtxparError("this LLM has been closed")
        return engine

    def add(self, request: EngineRequest) -> str:
        """Queue a prepared request; the LLM reads every output whole (cumulative)."""
        return self.require_llm_engine().add_processed_request(None, request, output_kind=RequestOutputKind.CUMULATIVE)

    def abort(self, request_id: str) -> None:
        """Forget the request, here and in the engine (if still open)."""
        self.mailbox.pop(request_id, None)
        if self.llm_engine is not None:
            self.llm_engine.abort_request(request_id)

    def poll(self, wanted: set[str]) -> list[RequestOutput]:
        """New outputs of the ``wanted`` requests: those another loop (an open
        stream, say) already stepped past, else one engine step's worth.

        Outputs are cumulative, so keeping only each request's latest one for
        its owner loses nothing; without it, two interleaved streams would
        swallow each other's outputs and wait forever."""
        mine = [self.mailbox.pop(r) for r in wanted if r in self.mailbox]
        if mine:
            return mine
        steps = self.require_engine().num_steps
        outs = self.require_llm_engine().step()
        # Nothing scheduled while no grammar compiles (a step waits for one only briefly): a bug.
        engine = self.require_engine()
        if engine.num_steps == steps and not outs and not engine.is_compiling_grammars():
            raise RuntimeError(f"the scheduler made no progress with {len(wanted)} requests unfinished")
        for out in outs:
            if out.request_id in wanted:
                mine.append(out)
            else:
                self.mailbox[out.request_id] = out
        return mine

    def run(self, request_ids: list[str], use_tqdm: UseTqdm) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in ``request_ids``' order.
        On any exception (Ctrl-C included) the unfinished ones are aborted."""
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = progress_bar(
                use_tqdm, total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True
            )
        try:
            n_tokens = 0
            while pending:
                for out in self.poll(pending):
                    if out.finished:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        n_tokens += sum(len(c.token_ids) for c in out.outputs)  # every sample of n
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} out tok/s")
        except BaseException:
            for rid in pending:  # never leave orphans behind in the engine
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]

    def close(self) -> None:
        """Release the LLMEngine (its executor and ranks); the loop cannot be used afterwards."""
        llm_engine, self.llm_engine = self.llm_engine, None
        if llm_engine is not None:
            llm_engine.close()
