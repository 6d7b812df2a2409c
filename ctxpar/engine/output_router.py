"""The engine thread's side of AsyncLLM's submissions (async_llm.py): which sink each
request in flight sends its outputs to. Only the engine thread touches it; what it
sends crosses to the submitter's event loop by ``call_soon_threadsafe`` (submission.py:
what crosses)."""

from __future__ import annotations

from ctxpar.engine.llm_engine import LLMEngine
from ctxpar.engine.submission import Aborted, AddBatch, Sink
from ctxpar.outputs import RequestOutput


class OutputRouter:
    """Request id -> the sink of the submission it came in."""

    def __init__(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self._sinks: dict[str, Sink] = {}

    def add(self, cmd: AddBatch) -> None:
        """The batch's requests into the engine, all or none."""
        added: list[str] = []
        try:
            for rid, request in zip(cmd.sink.request_ids, cmd.requests):
                self.llm_engine.add_processed_request(rid, request, cmd.arrival_time)
                added.append(rid)
                self._sinks[rid] = cmd.sink
        except Exception as e:  # a duplicate id, or a bug: all or nothing, and tell the caller
            self.abort(added)
            send(cmd.sink, e)

    def abort(self, request_ids: list[str]) -> None:
        mine = []
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                mine.append(rid)
                send(sink, Aborted(rid))
        if mine:
            self.llm_engine.abort_request(mine)

    def deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        send(sink, out)

    def fail_all(self, error: Exception) -> None:
        """Every request in flight ends with ``error`` (sent to its sink) and is aborted."""
        rids = list(self._sinks)
        for sink in {id(s): s for s in self._sinks.values()}.values():
            send(sink, error)
        self._sinks.clear()
        try:
            self.llm_engine.abort_request(rids)
        except Exception:
            pass  # a broken engine: its requests are failed above all the same


def send(sink: Sink, item: object) -> None:
    """``item`` onto the sink's queue, from any thread."""
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
    except RuntimeError:
        pass  # the event loop is closed: nobody is listening
