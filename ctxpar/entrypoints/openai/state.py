"""ServerState: what the routes share (the LLM, its AsyncLLM, the limits, who may
call what), kept on the app (``app.state.ctxpar``, set by app.build_app) and
given to a route by the ``ServerDep`` dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ctxpar.engine.async_llm import AsyncLLM
from ctxpar.entrypoints.openai.access import Access
from ctxpar.entrypoints.openai.limits import Admission, BodyBudget
from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.server_limits import ServerLimits
from ctxpar.entrypoints.openai.server_metrics import ServerMetrics


class ServerState:
    """What the routes share: the LLM (its engine and chat template), the async engine over
    it (whose loop the caller runs: ``engine_client.run_engine_loop()``), the name, who may
    call what (the API key), the parser of tool_choice "auto" (None: "auto" is refused) and
    the client limits (the grammar cache's among them)."""

    def __init__(
        self,
        llm,
        model_name: str,
        access: Access,
        tool_parser: str | None = None,
        limits: ServerLimits = ServerLimits(),
    ) -> None:
        self.llm = llm
        self.limits = limits
        self.admission = Admission(limits)
        self.budget = BodyBudget(limits)
        self.access = access
        self.tool_parser = tool_parser
        self.engine = llm.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.engine.structured.configure(
            limits.grammar_cache_bytes,
            limits.grammar_compile_timeout,
            limits.max_grammar_bytes,
            limits.grammar_memory_bytes,
        )
        self.engine.processor.os_random_seeds = True  # the n-th unseeded request is nobody's guess
        self.metrics = ServerMetrics(model_name)
        self.engine_client = AsyncLLM(llm.llm_engine, start_engine_loop=False, stat_loggers=[self.metrics])
        self.metrics.rank_recovery.source = lambda: self.engine_client.rank_recovery

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404, f"the model `{name}` does not exist; this server serves `{self.model_name}`", param="model"
            )


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (async: FastAPI runs a sync dependency on a worker thread)."""
    return request.app.state.ctxpar


# A route's parameter of this type gets the app's ServerState.
ServerDep = Annotated[ServerState, Depends(server_state)]
