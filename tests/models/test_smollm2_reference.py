"""The real model through the real engine against transformers.

SmolLM2-135M-Instruct runs through ``LLM.chat`` (chat template, paged KV
cache, scheduler, chunked prefill under a budget smaller than every prompt) at
P = 1 and P = 2, on three conversations of 0.9-1.3K tokens of real English
text: the documentation of Python standard-library modules. transformers'
greedy ``generate`` of the same GGUF (its own dequantiser and un-permute) is
the reference, for the tokens and for their logprobs.
"""

from __future__ import annotations

import codecs
import importlib
import inspect

import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.reference import assert_greedy_matches, transformers_greedy_logits

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

NEW_TOKENS = 16
BUDGET = 320  # max_num_batched_tokens: every prompt is prefilled in 3-5 chunks
# (stdlib modules whose documentation makes the document, its length in tokens)
DOCUMENTS = [(("json",), 900), (("re",), 1100), (("this", "argparse", "textwrap"), 1300)]
QUESTION = "\n\nSummarize the text above in one sentence."
# Measured here: logprobs of ctxpar (P = 1 or 2) and transformers differ by
# ~1e-5 on these prompts; the tolerances leave two orders of magnitude.
TIE = 5e-3  # a top-2 logit gap below this is a near-tie either engine may break
LOGPROB_TOL = 1e-3  # |engine - transformers| of a generated token's logprob
RANKS_TOL = 1e-4  # |P=2 - P=1| of a logprob (measured ~8e-6; scale of the logits ~44)


def module_doc(name: str) -> str:
    """A stdlib module's documentation as plain text: its docstring and those of its public members."""
    if name == "this":
        return _zen()
    mod = importlib.import_module(name)
    parts = [inspect.getdoc(mod) or ""]
    seen = set(parts)  # enum members and aliases repeat one docstring many times
    for key, value in sorted(vars(mod).items()):
        doc = inspect.getdoc(value)
        if not key.startswith("_") and getattr(value, "__module__", None) == name and doc and doc not in seen:
            parts.append(f"{key}: {doc}")
            seen.add(doc)
    return "\n\n".join(parts)


def _zen() -> str:
    """The Zen of Python: `this` stores it rot13-encoded and prints it on import."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13")


def conversations(tokenizer) -> list[list[dict]]:
    """One user turn per document: the text cut to its token length, then a question."""
    convs = []
    for names, length in DOCUMENTS:
        ids = tokenizer.encode("\n\n".join(module_doc(n) for n in names), add_special_tokens=False)
        assert len(ids) >= length, f"documentation of {names} is shorter than {length} tokens"
        convs.append([{"role": "user", "content": tokenizer.decode(ids[:length]) + QUESTION}])
    return convs


PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def outputs() -> dict[int, list]:
    """{pcp_size: LLM.chat outputs of the three conversations, batched in one call}."""
    out = {}
    with LLM(max_num_batched_tokens=BUDGET, quantization="none") as llm:
        convs = conversations(llm.get_tokenizer())
        out[1] = llm.chat(convs, PARAMS, use_tqdm=False)
    # The default PCP policy (docs/scaling.md) decides which chunks are split, and over which ranks.
    with LLM(pcp_size=2, max_num_batched_tokens=BUDGET, quantization="none") as llm:
        out[2] = llm.chat(convs, PARAMS, use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def reference(outputs, hf_smollm2) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and logits for each prompt, as the engine tokenized it."""
    return [transformers_greedy_logits(hf_smollm2, o.prompt_token_ids, NEW_TOKENS) for o in outputs[1]]


def test_prompts_are_long_and_chunked(outputs):
    lengths = [len(o.prompt_token_ids) for o in outputs[1]]
    assert all(2 * BUDGET < n < 1500 for n in lengths), lengths
    assert [o.prompt_token_ids for o in outputs[2]] == [o.prompt_token_ids for o in outputs[1]]


@pytest.mark.parametrize("pcp_size", [1, 2])
def test_greedy_tokens_and_logprobs_match_transformers(outputs, reference, pcp_size):
    compared = 0
    for i, (out, (want, logits)) in enumerate(zip(outputs[pcp_size], reference)):
        got = out.outputs[0].token_ids
        n = assert_greedy_matches(got, want, logits, TIE)
        compared += n
        ref_logprobs = torch.log_softmax(logits, -1)
        for k in range(n):  # the engine's logprob of each token the two agree on
            diff = abs(out.outputs[0].logprobs[k][got[k]].logprob - ref_logprobs[k, got[k]].item())
            assert diff < LOGPROB_TOL, f"prompt {i} token {k}: logprob differs by {diff:.3g}"
    # A near-tie may end a comparison early, but most tokens must be compared.
    assert compared >= len(reference) * NEW_TOKENS * 2 // 3, compared


def test_two_ranks_equal_one_rank(outputs):
    for one, two in zip(outputs[1], outputs[2]):
        a, b = one.outputs[0], two.outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in lp_a) < RANKS_TOL
