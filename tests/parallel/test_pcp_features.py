"""Request features at P = 2: logprobs, chat, stop strings and max_num_seqs
give what one rank gives (and logprobs what transformers gives).

One P = 1 and one P = 2 engine of the tiny Llama with a byte tokenizer serve
the whole module. Both share a small token budget (chunked prefill) and
max_num_seqs = 3; at P = 2 every prompt chunk of 4 tokens or more is split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

MAX_NUM_SEQS = 3
ENGINE = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=48, pcp_min_tokens=4, kv_cache_bytes=1 << 24)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> str:
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("features") / "llama_bytes"))


@pytest.fixture(scope="module")
def llms(model_dir):
    """{pcp_size: LLM}, each recording the number of requests in every step it runs."""
    with LLM(model_dir, **ENGINE) as one, LLM(model_dir, pcp_size=2, **ENGINE) as two:
        for llm in (one, two):
            executor = llm.engine.executor
            run = executor.execute
            llm.rows_per_step = []

            def recording(plan, run=run, rows=llm.rows_per_step):
                rows.append(len(plan.num_scheduled_tokens))
                return run(plan)

            executor.execute = recording
        yield {1: one, 2: two}


def token_prompts(lengths, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in lengths]


def test_logprobs_equal_one_rank_and_transformers(llms, model_dir):
    from transformers import AutoModelForCausalLM

    prompts = token_prompts((7, 60, 130))
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.2, seed=5, top_k=20, max_tokens=8, ignore_eos=True, logprobs=0),
    ]
    one, two = (llms[p].generate(prompts, params, use_tqdm=False) for p in (1, 2))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, sp, a, b in zip(prompts, params, one, two):
        a, b = a.outputs[0], b.outputs[0]
        assert b.token_ids == a.token_ids and len(b.logprobs) == sp.max_tokens
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids + b.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(ids) - 1 : -1], -1)  # the position predicting each output token
        for k, (tok, lp_a, lp_b) in enumerate(zip(b.token_ids, a.logprobs, b.logprobs)):
            assert lp_b.keys() == lp_a.keys()
            assert max(abs(lp_b[t].logprob - lp_a[t].logprob) for t in lp_a) < 1e-5
            assert tok in lp_b and set(ref[k].topk(sp.logprobs).indices.tolist()) <= set(lp_b)
            for t, v in lp_b.items():
                assert abs(v.logprob - ref[k, t].item()) < 1e-4, (len(ids), k, t)


def test_chat_equals_one_rank(llms):
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain context parallelism. " * 4}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c" * 70},
        ],
    ]
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    one, two = (llms[p].chat(conversations, sp, use_tqdm=False) for p in (1, 2))
    assert [o.prompt for o in two] == [o.prompt for o in one]
    assert two[1].prompt.startswith("<system>Be brief.\n<user>Explain") and len(two[1].prompt_token_ids) > 100
    assert [o.prompt_token_ids for o in two] == [o.prompt_token_ids for o in one]
    for a, b in zip(one, two):
        a, b = a.outputs[0], b.outputs[0]
        assert (b.token_ids, b.text) == (a.token_ids, a.text)
        # Tokens alone can survive a small fault in a random model: the logprobs cannot.
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.keys() == la.keys() and max(abs(lb[t].logprob - la[t].logprob) for t in la) < 1e-5


def test_stop_strings_cut_like_one_rank(llms):
    prompts = ["abc", "The quick brown fox jumps over the lazy dog. " * 3, "x" * 90]
    full = llms[1].generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    params, expected = [], []
    for i, out in enumerate(full):
        text = out.outputs[0].text
        assert len(text) > 12, text  # enough text to cut
        stop = text[5 + i : 7 + i]  # a string known to occur, at a different place per prompt
        params.append(SamplingParams(temperature=0, max_tokens=30, stop=["never-occurs", stop]))
        expected.append((text[: text.index(stop)], stop))
    for pcp_size in (1, 2):
        outs = llms[pcp_size].generate(prompts, params, use_tqdm=False)
        for out, full_out, (text, stop) in zip(outs, full, expected):
            c = out.outputs[0]
            assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", stop), pcp_size
            assert c.token_ids == full_out.outputs[0].token_ids[: len(c.token_ids)] and len(c.token_ids) < 30
    streamed = "".join(llms[2].stream(prompts[1], params[1]))
    assert streamed == expected[1][0]  # the stop string never leaks into the stream at P = 2 either


def test_more_requests_than_max_num_seqs_equal_one_rank(llms):
    prompts = token_prompts((3, 90, 17, 140, 50, 8, 33, 120), seed=1)
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=4 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results = {}
    for pcp_size in (1, 2):
        llm = llms[pcp_size]
        llm.rows_per_step.clear()
        results[pcp_size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # The limit is reached, never exceeded, and the run takes many steps of it.
        assert max(llm.rows_per_step) == MAX_NUM_SEQS, llm.rows_per_step
        assert llm.rows_per_step.count(MAX_NUM_SEQS) > 10
    assert results[2] == results[1]
    assert [len(t) for t in results[2]] == [sp.max_tokens for sp in params]
