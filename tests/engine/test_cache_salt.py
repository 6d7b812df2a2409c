"""``cache_salt`` (vLLM's per-request field): requests share prefix-cache blocks
only with requests of the same salt, so a client cannot learn from its time to
first token whether another tenant's prompt began with a given prefix. The
attack: tenant B sends the prompt tenant A sent; with different salts B finds
nothing cached."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.engine.block_manager import extend_block_hashes, hash_block
from ctxpar.errors import CtxparError

PROMPT = list(range(5, 105))  # 100 tokens: 6 full blocks of 16
PARAMS = SamplingParams(max_tokens=2, temperature=0)


def chain(tokens: list[int], salt: str | None = None, block_size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size, salt)
    return hashes


def test_salts_key_the_whole_chain() -> None:
    tokens = list(range(40))
    a, b, none = chain(tokens, "tenant-a"), chain(tokens, "tenant-b"), chain(tokens)
    assert not set(a) & set(b) and not set(a) & set(none)  # no block of one chain is in another
    assert chain(tokens, "tenant-a") == a  # the same salt: the same chain
    grown = chain(tokens[:20], "tenant-a")
    extend_block_hashes(grown, tokens[20:], 4, "tenant-a")  # grown later, per request: the salt is in block 0 only
    assert grown == a
    # No salt: the chain as it always was (block 0 hashes its tokens alone).
    assert none[0] == hashlib.sha256(array("q", tokens[:4]).tobytes()).digest()
    assert none[1] == hash_block(none[0], tokens[4:8])


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), device="cpu") as llm:
        yield llm


def cached(llm: LLM, salt: str | None, params: SamplingParams = PARAMS) -> int:
    prompt: dict = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out.num_cached_tokens


def test_different_salts_share_no_blocks_and_the_same_salt_does(llm) -> None:
    llm.reset_prefix_cache()
    assert cached(llm, "tenant-a") == 0
    assert cached(llm, "tenant-b") == 0  # B cannot find A's prompt
    assert cached(llm, None) == 0  # nor can a request without a salt
    assert cached(llm, "tenant-a") == 96  # A finds its own (all full blocks but the last)
    assert cached(llm, None) == 96  # and unsalted requests share with each other, as before


def test_samples_of_one_salted_prompt_share_it(llm) -> None:
    """n > 1: the first sample computes the prompt, the others (with its salt) start from its blocks."""
    llm.reset_prefix_cache()
    stats = llm.engine.scheduler.prefix_cache_stats
    hits = stats.hits
    prompt = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-c"}
    [out] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=1, seed=0, n=3), use_tqdm=False)
    assert len(out.outputs) == 3 and stats.hits - hits == 2 * 96


def test_the_salt_stays_with_its_prompt(llm) -> None:
    """One SamplingParams for a batch of differently salted prompts: each keeps its
    own salt, and the caller's object is not changed."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "tenant-d"}], params, use_tqdm=False)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT, "cache_salt": s} for s in ("tenant-e", "tenant-d")], params, use_tqdm=False
    )
    assert [o.num_cached_tokens for o in outs] == [0, 96]
    assert params.cache_salt is None


@pytest.mark.parametrize("salt", ["", 5])
def test_a_bad_salt_is_refused(llm, salt) -> None:
    with pytest.raises(CtxparError, match="'cache_salt' must be a non-empty string"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], PARAMS, use_tqdm=False)
