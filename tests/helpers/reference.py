"""References to compare ctxpar with: one sequence fed through a CausalLM chunk
by chunk, transformers' greedy generate, and a comparison of greedy tokens
that allows a divergence at a near-tie."""

from __future__ import annotations

import torch

from ctxpar.bench.cuda_models import transformers_greedy as transformers_greedy_logits  # noqa: F401  (the tests' name)


def single_sequence_context(kv_caches: list[torch.Tensor], start: int, length: int, kv_quant=None):
    """ForwardContext of one sequence computing positions [start, start + length).

    The flat cache slot of a token is its position, so the context of the row
    is slots arange(start + length) and the new entries go to their positions.
    kv_quant: the caches' quantization (ctxpar.layers.kv_quant.KVQuant), if any.
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
        kv_quant=kv_quant,
    )


class SingleSequence:
    """Feeds one sequence through a CausalLM chunk by chunk with a flat KV cache."""

    def __init__(self, model, max_len: int, dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "model") -> None:
        from ctxpar.layers.kv_quant import KVQuant
        from ctxpar.worker.kv_cache_allocation import allocate_kv_caches

        self.model = model
        self.kv_quant = KVQuant.of(kv_cache_dtype, tuple(model.kv_entry_shape), tuple(model.kv_scale_runs))
        shape, layers = tuple(model.kv_entry_shape), model.num_kv_layers
        self.kv_caches = allocate_kv_caches(layers, max_len, shape, dtype, torch.device("cpu"), self.kv_quant)
        self.pos = 0

    @torch.inference_mode()
    def step(self, ids) -> torch.Tensor:
        """Append token ids (list or (n,) tensor) and return their logits (n, vocab)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = ids.shape[0]
        ctx = single_sequence_context(self.kv_caches, self.pos, n, self.kv_quant)
        hidden = self.model.forward(ids, torch.arange(self.pos, self.pos + n), ctx)
        self.pos += n
        return self.model.compute_logits(hidden)


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
