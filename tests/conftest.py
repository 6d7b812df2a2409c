"""Shared fixtures: tiny random models built and saved with transformers.

The weights are random but real: transformers writes config.json and
safetensors exactly as for a hub checkpoint, so ctxpar loads them through its
normal path and the transformers forward pass is an independent reference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def save_tiny_model(config, path: Path, seed: int = 0) -> Path:
    """Instantiate a random transformers model for `config` and save it to `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), torch_dtype=torch.float32)
    # Random init is small; scale up so logits are not near-ties everywhere.
    # Biases (zero) and norm weights (one) are perturbed so loading them is tested too.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tiny_configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**TINY_COMMON, tie_word_embeddings=False),
        "llama3_rope": LlamaConfig(
            **TINY_COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": Qwen2Config(**TINY_COMMON),
        "qwen3": Qwen3Config(**TINY_COMMON, head_dim=32),
    }


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{name: directory} of tiny random Llama-family checkpoints."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(cfg, root / name) for name, cfg in tiny_configs().items()}


def single_sequence_context(kv_caches: list[torch.Tensor], start: int, length: int):
    """ForwardContext of one sequence computing positions [start, start + length).

    The flat cache slot of a token is its position, so the context of the row
    is slots arange(start + length) and the new entries go to their positions.
    """
    from ctxpar.layers.forward_context import ForwardContext

    return ForwardContext(
        query_start_loc=[0, length],
        start_pos=[start],
        seq_lens=[start + length],
        context_slots=[torch.arange(start + length)],
        write_src=None,
        write_slots=torch.arange(start, start + length),
        kv_caches=kv_caches,
    )


class SingleSequence:
    """Feeds one sequence through a CausalLM chunk by chunk with a flat KV cache."""

    def __init__(self, model, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.kv_caches = [torch.zeros(max_len, *model.kv_entry_shape, dtype=dtype) for _ in range(model.num_kv_layers)]
        self.pos = 0

    @torch.inference_mode()
    def step(self, ids) -> torch.Tensor:
        """Append token ids (list or (n,) tensor) and return their logits (n, vocab)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = ids.shape[0]
        ctx = single_sequence_context(self.kv_caches, self.pos, n)
        hidden = self.model.forward(ids, torch.arange(self.pos, self.pos + n), ctx)
        self.pos += n
        return self.model.compute_logits(hidden)


def transformers_greedy_logits(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The reference: transformers' greedy `generate`, never stopping early.

    Returns the generated ids and the raw logits (max_new_tokens, vocab) each
    one was chosen from, so callers can tell real mismatches from near-ties.
    """
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def transformers_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference tokens alone (see transformers_greedy_logits)."""
    return transformers_greedy_logits(hf_model, prompt, max_new_tokens)[0]


def assert_greedy_matches(got: list[int], want: list[int], ref_logits: torch.Tensor, tie: float) -> int:
    """Assert engine tokens `got` equal reference tokens `want`, allowing one
    divergence at a near-tie (random-weight models have near-ties between their
    top two logits): where the reference's top-2 logit gap is below `tie`, two
    fp32 engines may pick either token, and after that the sequences are not
    comparable. Returns how many tokens were compared.
    """
    for k, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        top2 = ref_logits[k].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        assert gap < tie and g in top2.indices.tolist(), (
            f"token {k}: engine chose {g}, reference {w}; reference top-2 gap {gap:.3g} is not a near-tie (< {tie})"
        )
        return k
    assert len(got) == len(want), f"engine made {len(got)} tokens, reference {len(want)}"
    return len(got)


@pytest.fixture(params=["native", "haswell"])
def march(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernels built for this CPU, and for an AVX2-only one (the code path of
    CPUs without AVX-512: 8-float vectors, smaller tiles), which this CPU runs too."""
    from ctxpar import kernels
    from ctxpar.machine import cpu_info

    if request.param != "native":
        if "avx2" not in cpu_info().flags:
            pytest.fail("this CPU cannot run an AVX2 build")
        lib = kernels._library(request.param)
        # Built without AVX-512: vectors of 8, so a 32-wide value is whole tiles of 4 vectors.
        assert lib is not None and lib.prefill_attention_supports(8, 32)
        monkeypatch.setattr(kernels, "_library", lambda march="native": lib)
    return request.param
