"""A constrained request's grammar, compiled before the request is handed to the engine.

The route waits for the compile (in the engine's grammar worker process, through its
cache, so that the request's preparation finds it there) for at most the server's
--grammar-compile-timeout: a client's schema that takes longer gets a 408 naming the
timeout (its compile is killed), one over --max-grammar-bytes or that xgrammar cannot
compile a 400, before any of it reaches the engine.
"""

from __future__ import annotations

import asyncio

from ctxpar.engine.sample.grammar_worker import START_TIMEOUT_S, GrammarTimeout
from ctxpar.engine.sample.structured_output import StructuredOutputs
from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.structured_params import StructuredOutputsParams


async def compile_first(structured: StructuredOutputs, spec: StructuredOutputsParams | None) -> None:
    """Return once ``spec``'s grammar is compiled (None: nothing to compile); a 400 if it is
    invalid or fails to compile, a 408 past the compile timeout."""
    if spec is None:
        return
    loop = asyncio.get_running_loop()
    # Parsing a large schema takes a while too: not on the loop. A bad one raises CtxparError (a 400).
    compiled = await loop.run_in_executor(None, structured.compile, spec)
    backend = structured.backend
    # The compile's own time: a compiler process still starting (the first grammar, or the
    # next after one was killed) has START_TIMEOUT_S more, bounded by the worker as well.
    grace = 0.0 if backend.worker.ready else START_TIMEOUT_S
    await asyncio.wait([asyncio.wrap_future(compiled)], timeout=backend.compile_timeout + grace)
    if not compiled.done() or compiled.cancelled():
        # One still queued behind others is dropped (a running one ends at the worker's own
        # deadline), so that abandoned compiles do not pile up on the compile thread.
        if compiled.cancel():
            backend.cache.discard(spec.key(), compiled)
        raise ApiError(408, str(backend.timeout_error()))
    error = compiled.exception()
    if isinstance(error, GrammarTimeout):
        raise ApiError(408, str(error))
    if error is not None:
        raise ApiError(400, f"the grammar failed to compile: {error}")
