"""A constrained request's grammar, compiled before the request is handed to the engine.

The route waits for the compile (off the event loop, on the engine's grammar
cache, so the engine finds it there) for at most the server's
--grammar-compile-timeout: a client's schema that takes longer gets a 408
naming the timeout, and one xgrammar cannot compile a 400, before any of it
reaches the engine.
"""

from __future__ import annotations

import asyncio

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
    await asyncio.wait([asyncio.wrap_future(compiled)], timeout=backend.compile_timeout)
    if not compiled.done() or compiled.cancelled():
        # One still queued behind others is dropped (running, xgrammar cannot stop it), so
        # that abandoned compiles do not pile up on the compile thread.
        if compiled.cancel():
            backend.cache.discard(spec.key(), compiled)
        raise ApiError(408, str(backend.timeout_error()))
    error = compiled.exception()
    if error is not None:
        raise ApiError(400, f"the grammar failed to compile: {error}")
