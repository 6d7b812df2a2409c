"""vLLM's ``LLM(...)`` constructor arguments that are not EngineConfig fields.

A script written for vLLM passes arguments ctxpar has no use for. Each one is
sorted here by what ignoring it would do:

- a HINT changes only speed or memory, never an output: accepted, and one
  log line says it is ignored and why;
- a REFUSED argument would change the outputs if ignored (another model, other
  weights, other tokens): any value but vLLM's neutral one is a CtxparError
  naming the argument and what to do instead.

Arguments that mean something here (``tokenizer``, ``seed``,
``generation_config``, ...) are parameters of ``LLM.__init__`` itself.
docs/vllm.md lists all three kinds; a test keeps it in step with these tables.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ctxpar.errors import CtxparError

logger = logging.getLogger("ctxpar")

# name -> why ctxpar can ignore it.
HINTS: dict[str, str] = {
    "disable_log_stats": "ctxpar logs no periodic statistics",
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_bytes or num_kv_blocks",
    "swap_space": "a preempted request is recomputed, never swapped",
    "cpu_offload_gb": "weights stay on the device they run on",
    "max_seq_len_to_capture": "ctxpar's CUDA graphs cover every context up to max_model_len (enforce_eager: none)",
    "compilation_config": "ctxpar uses no torch.compile: its decode step is a compiled loop on the CPU and CUDA "
    "graphs on a GPU, both off with enforce_eager",
    "disable_custom_all_reduce": "ctxpar has no tensor-parallel all-reduce",
    "disable_async_output_proc": "outputs are processed in the engine step",
    "async_scheduling": "ctxpar schedules each step synchronously",
    "enable_chunked_prefill": "ctxpar always chunks long prefills (max_num_batched_tokens)",
    "distributed_executor_backend": "ranks are processes started by ctxpar (or torchrun)",
    "served_model_name": "only `ctxpar serve --served-model-name` uses a model name",
    "hf_token": "ctxpar loads local files and downloads nothing",
    "download_dir": "ctxpar loads local files and downloads nothing",
    "disable_log_requests": "ctxpar logs no requests",
    "enable_log_requests": "ctxpar logs no requests",
    "max_loras": "ctxpar has no LoRA adapters (enable_lora is refused)",
    "max_lora_rank": "ctxpar has no LoRA adapters (enable_lora is refused)",
    "max_cpu_loras": "ctxpar has no LoRA adapters (enable_lora is refused)",
    "enable_sleep_mode": "ctxpar has no sleep mode",
    "scheduling_policy": "requests are scheduled first come, first served",
    "num_gpu_blocks_override": "the KV cache is sized by kv_cache_bytes or num_kv_blocks",
    "num_scheduler_steps": "ctxpar schedules every step",
    "use_v2_block_manager": "ctxpar has one block manager",
    "model_impl": "ctxpar runs its own model implementations",
    "enable_expert_parallel": "MoE experts run on every rank",
    "guided_decoding_backend": "ctxpar's structured outputs always use xgrammar, vLLM's default backend",
    "structured_outputs_config": "ctxpar's structured outputs always use xgrammar, vLLM's default backend",
    "allowed_local_media_path": "ctxpar runs text-only models",
    "limit_mm_per_prompt": "ctxpar runs text-only models",
    "mm_processor_kwargs": "ctxpar runs text-only models",
}

NO_LORA = (
    "ctxpar has no LoRA adapters; merge the adapter into the weights (peft's merge_and_unload) "
    "and load the merged checkpoint"
)
# name -> (vLLM's neutral values, accepted silently; what to do instead of any other).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tensor_parallel_size": (
        (1,),
        "ctxpar has no tensor parallelism; it splits each long prompt across ranks instead: "
        "use pcp_size=N (same outputs as one rank)",
    ),
    "pipeline_parallel_size": ((1,), "ctxpar has no pipeline parallelism; use pcp_size=N"),
    "data_parallel_size": ((1,), "ctxpar has no data parallelism; start one LLM per device"),
    "enable_lora": ((False,), NO_LORA),
    "revision": ((None,), "ctxpar loads local files only: check out that revision and pass its directory"),
    "tokenizer_revision": ((None,), "ctxpar loads local files only: check out that revision and pass its directory"),
    "code_revision": ((None,), "ctxpar runs its own model code, never the checkpoint's"),
    "load_format": (("auto", "safetensors"), "ctxpar loads safetensors directories and .gguf files"),
    "task": (("auto", "generate"), "ctxpar runs generative models only"),
    "runner": (("auto", "generate"), "ctxpar runs generative models only"),
    "tokenizer_mode": (("auto", "hf"), "ctxpar loads the Hugging Face tokenizer (tokenizer_mode='auto')"),
    "logits_processors": ((None, []), "ctxpar has no custom logits processors"),
    "rope_scaling": ((None, {}), "pass hf_overrides={'rope_scaling': {...}} (vLLM's current spelling)"),
    "rope_theta": ((None,), "pass hf_overrides={'rope_theta': ...} (vLLM's current spelling)"),
    "worker_cls": (("auto",), "ctxpar's ranks run ctxpar's own worker"),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # `True == 1` in Python: a bool is never taken for a size, nor 1 for True.
    return any(type(value) is type(n) and value == n for n in neutral)


def apply_vllm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check and drop vLLM's hint and refused arguments from ``kwargs``;
    returns the rest (EngineConfig fields and unknown names) untouched.

    Raises CtxparError for a refused argument with a non-neutral value.
    """
    rest = {}
    for name, value in kwargs.items():
        if name in REFUSED:
            neutral, instead = REFUSED[name]
            if not _is_neutral(value, neutral):
                raise CtxparError(f"{name}={value!r} is not supported: {instead}")
        elif name in HINTS:
            logger.warning("ctxpar: ignoring %s=%r: %s", name, value, HINTS[name])
        else:
            rest[name] = value
    return rest


def refuse_lora(lora_request: Any) -> None:
    """The lora_request argument of generate, chat and beam_search: only None."""
    if lora_request is not None:
        raise CtxparError(f"lora_request is not supported: {NO_LORA}")


def load_tokenizer(path: Any, trust_remote_code: bool) -> Any:
    """The tokenizer= argument: a local Hugging Face tokenizer directory."""
    if not isinstance(path, str) or not Path(path).expanduser().is_dir():
        raise CtxparError(
            f"tokenizer={path!r} is not a directory; pass a local Hugging Face tokenizer directory "
            "(ctxpar downloads nothing) or leave it None for the model's own"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CtxparError(f"cannot load the tokenizer in {path}: {e}") from e
