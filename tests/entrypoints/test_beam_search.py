"""LLM.beam_search against an independent brute-force beam search over
transformers' logits: every continuation of every beam is scored from the full
vocabulary, without a KV cache (issue 12).

One rule is vLLM's and not a brute-force one: a beam completes with EOS only
when EOS is among its 2 * beam_width most likely next tokens (the candidates
vLLM looks at). Without it, a short, unlikely EOS ending could win on the
length-normalised score. Every other continuation is taken from the whole
vocabulary: the beams kept are the same as with the candidate limit, since
the beam_width best continuations of a step are among each beam's best 2 * beam_width."""

from __future__ import annotations

import functools
import io
import json
import shutil

import pytest
import torch
from tqdm import tqdm

from ctxpar import LLM, BeamSearchOutput
from ctxpar.errors import CtxparError
from ctxpar.sampling_params import BeamSearchParams

BLOCK = 16


@torch.no_grad()
def brute_force(hf_model, prompt: list[int], width: int, steps: int, eos: int | None, length_penalty: float):
    """All (tokens, cum_logprob) the search keeps, best first, and the smallest
    relative score gap at any cut (below it, fp32 noise may order beams either way)."""

    def score(tokens, cum):
        n = len(tokens) - (eos is not None and tokens[-1] == eos)
        return cum / n**length_penalty

    def rel_gap(kept, dropped):
        return (kept - dropped) / abs(kept)

    live, done, min_gap = [(list(prompt), 0.0)], [], float("inf")
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            logprobs = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0, -1].double(), -1)
            for t, lp in enumerate(logprobs.tolist()):
                if t != eos:
                    grown.append((tokens + [t], cum + lp))
                elif (logprobs > lp).sum() < 2 * width:  # EOS ranks among the candidates
                    done.append((tokens + [t], cum + lp))
        grown.sort(key=lambda b: score(*b), reverse=True)
        min_gap = min(min_gap, rel_gap(score(*grown[width - 1]), score(*grown[width])))
        live = grown[:width]
    final = sorted(done + live, key=lambda b: score(*b), reverse=True)
    if len(final) > width:
        min_gap = min(min_gap, rel_gap(score(*final[width - 1]), score(*final[width])))
    return final[:width], min_gap


def assert_same_beams(out: BeamSearchOutput, want, gap: float, prompt_len: int) -> None:
    assert gap > 1e-5, "a near-tie: pick another prompt"  # the test's own precondition
    got = [(s.tokens, s.cum_logprob) for s in out.sequences]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    for s in out.sequences:
        assert len(s.logprobs) == len(s.tokens) - prompt_len  # a dict of candidates per generated token
        assert s.finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


def test_beam_search_matches_brute_force(tiny_model_dirs, hf_llama):
    width, steps = 3, 4
    prompts = [list(range(7, 7 + 40)), [3, 1, 4, 1, 5]]  # 40 tokens: two full blocks the beams share
    with LLM(str(tiny_model_dirs["llama"]), block_size=BLOCK, kv_cache_bytes=1 << 22) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(width, steps))
        hits = llm.engine.scheduler.prefix_cache_stats.hits
    for out, prompt in zip(outs, prompts):
        want, gap = brute_force(hf_llama, prompt, width, steps, eos=None, length_penalty=1.0)
        assert_same_beams(out, want, gap, len(prompt))
        assert all(s.text is None for s in out.sequences)  # this model has no tokenizer
    # After the first step every beam of the long prompt finds its two prompt blocks cached.
    assert hits >= 2 * BLOCK * width * (steps - 1)


def test_beam_search_with_eos_and_length_penalty(tiny_model_dirs, hf_llama, tmp_path):
    prompt, width, steps = [9, 8, 7, 6, 5], 2, 5
    # The EOS: the token the model finds second most likely after the prompt, so some beams end early.
    with torch.no_grad():
        eos = hf_llama(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1].item()
    model = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "eos")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    with LLM(str(model), kv_cache_bytes=1 << 22) as llm:
        best = {}
        for length_penalty in (0.0, 1.0, 5.0):
            params = BeamSearchParams(width, steps, length_penalty=length_penalty)
            [out] = llm.beam_search([{"prompt_token_ids": prompt}], params)
            want, gap = brute_force(hf_llama, prompt, width, steps, eos=eos, length_penalty=length_penalty)
            assert_same_beams(out, want, gap, len(prompt))
            best[length_penalty] = out.sequences[0]
        # Without a penalty the short EOS ending wins; a strong one favours the longer beam.
        assert best[0.0].tokens[-1] == eos and best[0.0].finish_reason == "stop"
        assert best[5.0].finish_reason == "length" and len(best[5.0].tokens) == len(prompt) + steps
        # ignore_eos: EOS is a token like any other, beams run to max_tokens.
        [out] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, steps, ignore_eos=True))
        want, gap = brute_force(hf_llama, prompt, width, steps, eos=None, length_penalty=1.0)
        assert_same_beams(out, want, gap, len(prompt))
        assert all(len(s.tokens) == len(prompt) + steps for s in out.sequences)


def test_beam_search_bad_input(tiny_model_dirs):
    with pytest.raises(CtxparError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(CtxparError, match="length_penalty"):
        BeamSearchParams(2, 4, length_penalty=float("nan"))
    with LLM(str(tiny_model_dirs["llama"]), max_model_len=16, kv_cache_bytes=1 << 22) as llm:
        with pytest.raises(CtxparError, match="BeamSearchParams"):
            llm.beam_search([{"prompt_token_ids": [1]}], {"beam_width": 2})
        with pytest.raises(CtxparError, match="max_model_len"):
            llm.beam_search([{"prompt_token_ids": list(range(20))}], BeamSearchParams(2, 4))
        # Beams that reach max_model_len complete there ("length") instead of failing.
        sink = io.StringIO()
        bar = functools.partial(tqdm, file=sink)  # use_tqdm as a callable: a bar over the token steps
        [out] = llm.beam_search([{"prompt_token_ids": list(range(1, 13))}], BeamSearchParams(2, 10), use_tqdm=bar)
        assert all(len(s.tokens) == 16 and s.finish_reason == "length" for s in out.sequences)
        assert "Beam search" in sink.getvalue()
