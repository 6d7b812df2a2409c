"""The real model with its KV cache sharded over two ranks (P = D = 2): greedy
chat tokens and their logprobs equal transformers' greedy ``generate`` of the
same GGUF. The prompt is split across the ranks (pcp_min_tokens below its
length) and prefilled in chunks, so split and replicated rows both attend
over the shards."""

from __future__ import annotations

import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.reference import assert_greedy_matches, transformers_greedy_logits

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

NEW_TOKENS = 12
TIE = 5e-3  # as test_smollm2_reference.py
LOGPROB_TOL = 1e-3


def test_sharded_cache_chat_matches_transformers(hf_smollm2):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    conv = [{"role": "user", "content": "Explain in two sentences why the sky is blue, for a child."}]
    with LLM(
        pcp_size=2, dcp_size=2, cp_interleave=4, pcp_min_tokens=8, max_num_batched_tokens=24, quantization="none"
    ) as llm:
        [out] = llm.chat(conv, params, use_tqdm=False)
    assert len(out.prompt_token_ids) > 24  # chunked, and split while prefilling
    want, logits = transformers_greedy_logits(hf_smollm2, out.prompt_token_ids, NEW_TOKENS)
    got = out.outputs[0]
    n = assert_greedy_matches(got.token_ids, want, logits, TIE)
    assert n >= NEW_TOKENS * 2 // 3, n
    ref = torch.log_softmax(logits, -1)
    for k in range(n):
        assert abs(got.logprobs[k][got.token_ids[k]].logprob - ref[k, got.token_ids[k]].item()) < LOGPROB_TOL, k
