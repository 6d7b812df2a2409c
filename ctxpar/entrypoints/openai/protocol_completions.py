"""The body of POST /v1/completions: prompts (text or token ids), echo, best_of."""

from __future__ import annotations

from typing import Any, ClassVar, cast

from ctxpar.entrypoints.openai.protocol import ApiError, SamplingRequest


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM extension: the tokenizer's BOS (and the like) on a text prompt
    prompt_embeds: Any = None  # vLLM's; refused (UNSUPPORTED)

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SamplingRequest.UNSUPPORTED,
        "suffix": ((None,), "no insertion (fill-in-the-middle) mode"),
        "prompt_embeds": ((None,), "prompts are text or token ids; embeddings are not taken"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of > self.n and self.stream:
            # The best n are known only once all best_of samples have finished.
            raise ApiError(400, f"best_of={self.best_of} > n={self.n} cannot stream: set stream=false", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400, "max_tokens=0 generates nothing: it needs echo=true (the prompt scored)", param="max_tokens"
            )

    def default_max_tokens(self, room: int) -> int:
        return 16  # OpenAI's default for completions

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        # echo with logprobs scores the prompt too (vLLM's rule): its tokens' logprobs, as many as logprobs asks
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        # A list of prompts: pydantic validated it as one of the union's lists, and its first item is no token id.
        return [item for item in cast(list[str] | list[list[int]], p)]
