"""ServerState: what the routes share (the LLM, its AsyncLLM, the limits, who may
call what), kept on the app (``app.state.ctxpar``, set by app.build_app) and
given to a route by the ``ServerDep`` dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ctxpar.engine.async_llm import AsyncLLM
from ctxpar.engine.input_processor import EngineRequest
from ctxpar.entrypoints.openai.access import Access
from ctxpar.entrypoints.openai.limits import Admission, BodyBudget, ServerLimits
from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.protocol_chat import ChatCompletionRequest
from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
from ctxpar.entrypoints.openai.server_metrics import ServerMetrics
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams


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
        self.engine.structured.configure(limits.grammar_cache_bytes, limits.grammar_compile_timeout)
        self.metrics = ServerMetrics(model_name)
        self.engine_client = AsyncLLM(llm.llm_engine, start_engine_loop=False, stat_loggers=[self.metrics])
        self.metrics.rank_recovery.source = lambda: self.engine_client.rank_recovery

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404, f"the model `{name}` does not exist; this server serves `{self.model_name}`", param="model"
            )

    def render_chat(self, messages: list, chat_template_kwargs: dict | None = None, tools: list | None = None) -> dict:
        """{"prompt", "prompt_token_ids"} of the conversation, as LLM.chat renders it."""
        try:
            [rendered] = self.llm.apply_chat_template(
                [m.as_template_input() for m in messages], chat_template_kwargs, tools=tools
            )
        except (CtxparError, ApiError):
            raise
        except Exception as e:  # the template's own refusal (jinja), e.g. roles out of order
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
        return rendered

    # The two below run on a worker thread: tokenizing or templating a 16 MiB body takes
    # seconds, which on the event loop would stall every stream.
    def prepare_prompts(
        self, req: CompletionRequest, prompts: list[str | list[int]], constraint: StructuredOutputsParams | None
    ) -> list[EngineRequest]:
        """The engine's request of each prompt of a completion request, checked."""
        out = []
        for p in prompts:
            text, ids = (p, self.encode(p)) if isinstance(p, str) else (None, p)
            params = req.sampling_params(len(ids), self.engine.max_model_len, req.logprobs, constraint)
            out.append(self.engine.processor.process_tokens(ids, params, text))
        return out

    def prepare_chat(self, req: ChatCompletionRequest, constraint: StructuredOutputsParams | None) -> EngineRequest:
        """The engine's request of a chat request: its rendered conversation, checked."""
        rendered = self.render_chat(req.messages, req.chat_template_kwargs, req.tools)
        ids = rendered["prompt_token_ids"]
        params = req.sampling_params(len(ids), self.engine.max_model_len, req.num_logprobs, constraint)
        return self.engine.processor.process_tokens(ids, params, rendered["prompt"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The same tokenization as LLM.generate's, so outputs match it token for token.
        if self.tokenizer is None:
            raise CtxparError("this model has no tokenizer: send the prompt as token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (async: FastAPI runs a sync dependency on a worker thread)."""
    return request.app.state.ctxpar


# A route's parameter of this type gets the app's ServerState.
ServerDep = Annotated[ServerState, Depends(server_state)]
