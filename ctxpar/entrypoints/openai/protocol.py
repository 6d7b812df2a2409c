"""What every OpenAI request body ctxpar serves shares: strict parsing, the error
answered for a bad one, and the sampling fields' translation to SamplingParams.
The bodies themselves: protocol_completions.py, protocol_chat.py, protocol_tokens.py.

Bodies are parsed strictly (no "5" for 5) and unknown fields are refused:
a field the server ignored would silently change what the client asked for.
Every field of vLLM's request models is declared: honoured, or (``UNSUPPORTED``)
accepted only at its neutral value, any other value a 400 naming the field and
why; docs/vllm.md lists them all.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ctxpar.errors import CtxparError
from ctxpar.sampling_params import SamplingParams, StructuredOutputsParams

# OpenAI's cap on completions' `logprobs` is 5 and on chat's `top_logprobs` 20;
# like vLLM, one limit for both (the engine itself has none).
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        408: "timeout_error",
        413: "invalid_request_error",
        503: "service_unavailable",
        500: "internal_error",
    }

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}  # e.g. Retry-After on a 503 of an overloaded server

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.status,
            }
        }


class StrictBody(BaseModel):
    """A request body: no type coerced, no unknown field accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_REQUEST_ID_CHARS = 256  # echoed in the response's id: a client's label, not a payload


class StreamOptions(StrictBody):
    include_usage: bool = False
    # vLLM extension: with include_usage, every chunk carries the usage so far, not only the last
    continuous_usage_stats: bool = False


# vLLM's fields the engine has no use for, refused at any other value than these (field -> (neutral values, why)).
VLLM_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False,), "the server has no beam search; LLM.beam_search offers it offline"),
    "length_penalty": ((1.0, 1), "it weighs beam search, which the server does not run"),
    "logprob_token_ids": ((None,), "logprobs of chosen token ids are not implemented; use logprobs=N"),
    "logits_processors": ((None,), "the server loads no code named by a request"),
    "vllm_xargs": ((None,), "ctxpar has no custom extensions to pass them to"),
    "kv_transfer_params": ((None,), "ctxpar has no disaggregated prefill"),
    "ec_transfer_params": ((None,), "ctxpar has no disaggregated encoder cache"),
    "repetition_detection": ((None,), "repetition detection is not implemented"),
    "max_repetition_pattern_size": ((0,), "repetition detection is not implemented"),
    "min_repetition_pattern_size": ((0,), "repetition detection is not implemented"),
    "repetition_min_count": ((0,), "repetition detection is not implemented"),
    "thinking_token_budget": ((None, -1), "no reasoning parser: the thinking budget cannot be counted"),
    "routed_experts_prompt_start": ((0,), "ctxpar returns no routed-expert data"),
    "watermarking": ((None, False), "watermarking is not implemented"),
}


class SamplingRequest(StrictBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = -1  # vLLM extension; 0 or -1 disables
    min_p: float = 0.0  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM extension: prompt_token_ids and token_ids in the response
    user: str | None = None  # an end-user id for abuse monitoring: has no effect on generation
    # vLLM extension: requests share prefix-cache blocks only with requests of the same salt
    # (a tenant's secret), so one cannot time another's prompts.
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias
    min_tokens: int = 0  # vLLM extension
    bad_words: list[str] | None = None  # vLLM extension
    allowed_token_ids: list[int] | None = None  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    spaces_between_special_tokens: bool = True  # vLLM extension
    n: int = 1  # choices per prompt; they share the prompt's KV blocks
    prompt_logprobs: int | None = None  # vLLM extension: logprobs of every prompt token (not streamed)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extensions: the prompt's tokens.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # keep k tokens; -1: what fits
    truncation_side: Literal["left", "right"] | None = None  # which end truncation cuts (default: the start)
    # vLLM extensions: the request's handling and its answer.
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # lower is scheduled earlier (engine/scheduler.py)
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)  # the response's id
    session_id: str | None = None  # routing hint across requests: one server, nothing to route
    return_token_offsets: bool | None = None  # vLLM reads it only on its /render endpoints
    return_mm_kwargs: bool = True  # likewise (and ctxpar runs text models)
    stream_interval: int | None = Field(None, ge=1)  # tokens per streamed chunk, at least
    # vLLM's fields, refused unless neutral (VLLM_UNSUPPORTED): typed Any so that any value gets the reason.
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    logprob_token_ids: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    repetition_detection: Any = None
    max_repetition_pattern_size: Any = 0
    min_repetition_pattern_size: Any = 0
    repetition_min_count: Any = 0
    thinking_token_budget: Any = None
    routed_experts_prompt_start: Any = 0
    watermarking: Any = None

    # Defined by OpenAI or vLLM, not implemented: field -> (neutral values, why it is refused otherwise)
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = VLLM_UNSUPPORTED

    def check_supported(self) -> None:
        for name, (neutral, why) in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
                raise ApiError(400, f"{name}={value!r} is not supported: {why}", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(
                400, "prompt_logprobs are returned only without streaming: set stream=false", param="prompt_logprobs"
            )
        if self.cache_salt == "":
            raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint the body asks for (at most one way of asking); a 400 if malformed."""
        guided = {
            k: v
            for k, v in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if v is not None
        }
        asked = {
            "response_format": _response_format(self.response_format),
            "structured_outputs": self.structured_outputs,
            "guided_*": guided or None,
        }
        given = {k: v for k, v in asked.items() if v is not None}
        if len(given) > 1:
            raise ApiError(400, f"give one of {' and '.join(given)}, not both", param=next(iter(given)))
        if not given:
            return None
        [(where, fields)] = given.items()
        try:
            return StructuredOutputsParams(**fields)
        except TypeError as e:  # an unknown field name
            raise ApiError(400, f"{where}: {e}", param=where.rstrip("_*")) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's continuous_usage_stats, which needs include_usage as there)."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens after truncate_prompt_tokens: the last k (truncation_side "left",
        vLLM's default) or the first k ("right"); -1 keeps what leaves room for max_tokens (or one)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise ApiError(
                400, "truncate_prompt_tokens must be >= 1, or -1 (what fits)", param="truncate_prompt_tokens"
            )
        keep = max_model_len - max(self.max_tokens or 1, 1) if k == -1 else k
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams for one prompt; CtxparError (a 400) on a bad value.

        Without max_tokens a request may use the rest of the context (vLLM's
        default); with one, prompt + max_tokens must fit in it, as OpenAI and
        vLLM require, rather than being cut short without a word."""
        room = max_model_len - num_prompt_tokens
        max_tokens = self.max_tokens if self.max_tokens is not None else self.default_max_tokens(room)
        if self.echo_only:
            max_tokens = 1  # as vLLM: one token is generated, and left out of the answer
        if max_tokens > room and room > 0:
            raise CtxparError(
                f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} prompt "
                f"tokens + max_tokens={max_tokens} is {num_prompt_tokens + max_tokens}; lower max_tokens to at "
                f"most {room} or shorten the prompt"
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise CtxparError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
        params = SamplingParams(
            n=self.n,
            best_of=getattr(self, "best_of", None),
            prompt_logprobs=self.prompt_logprobs_wanted,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.token_logit_bias(),
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=-1 if self.top_k == 0 else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs,
        )
        params.cache_salt = self.cache_salt
        return params

    def default_max_tokens(self, room: int) -> int:
        return max(room, 1)  # a too-long prompt is refused by the engine's own check

    @property
    def echo_only(self) -> bool:
        """The prompt is answered alone, nothing generated (completions' echo with max_tokens 0)."""
        return False

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """How many logprobs the engine computes for each prompt token (None: none)."""
        return self.prompt_logprobs

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids, each bias clamped to [-100, 100] (OpenAI's range, as vLLM)."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
            out[token] = min(100.0, max(-100.0, bias)) if bias == bias else bias  # NaN: refused by SamplingParams
        return out


def _response_format(rf: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as StructuredOutputsParams fields (None: free text)."""
    if rf is None or rf.get("type") == "text":
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None:
            raise ApiError(400, "response_format.json_schema.schema is missing", param="response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": {k: v for k, v in rf.items() if k != "type"} | {"type": "structural_tag"}}
    raise ApiError(
        400,
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag",
        param="response_format",
    )


def parse(model: type[StrictBody], body: bytes) -> Any:
    """Parse a JSON body into ``model``; a 400 naming the first bad field otherwise."""
    try:
        req = model.model_validate_json(body or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise ApiError(400, f"{where}: {err['msg']}", param=where.split(".")[0]) from None
    check = getattr(req, "check_supported", None)
    if check is not None:
        check()
    return req
