"""The body of POST /v1/completions: prompts (text or token ids), echo, best_of."""

from __future__ import annotations

from typing import ClassVar, cast

from ctxpar.entrypoints.openai.protocol import ApiError, SamplingRequest


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SamplingRequest.UNSUPPORTED,
        "suffix": ((None,), "no insertion (fill-in-the-middle) mode"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of > self.n and self.stream:
            # The best n are known only once all best_of samples have finished.
            raise ApiError(400, f"best_of={self.best_of} > n={self.n} cannot stream: set stream=false", param="best_of")
        if self.echo and self.logprobs is not None:
            raise ApiError(
                400,
                "echo with logprobs is not supported (the prompt's would be needed): use prompt_logprobs for them",
                param="echo",
            )

    def default_max_tokens(self, room: int) -> int:
        return 16  # OpenAI's default for completions

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        # A list of prompts: pydantic validated it as one of the union's lists, and its first item is no token id.
        return [item for item in cast(list[str] | list[list[int]], p)]
