"""The real SmolLM2 Q4_1 GGUF with its blocks kept quantized (quantization="gguf")
against the same file dequantized to fp32 (quantization="none", the path the
tests against transformers check), through the real engine, at P = 1 and 2.

- loading keeps every projection and the (tied, Q8_0) embedding as QuantWeights;
- every row, a prefill's and a decode's alike, runs the integer kernel, whose
  activations are rounded to int8 per block of 32 (relative error up to 1/254
  a block): prompt logprobs and the generated tokens' logprobs move by up to
  ~0.2 nats against the fp32 path, so the tolerance is 0.5, and greedy tokens
  agree wherever the fp32 path's top two differ by more than 1 nat (a smaller
  gap is within what that rounding moves);
- P = 2 against P = 1 with the same quantization: the very same tokens,
  logprobs and prompt logprobs, bit for bit, for the prompts replicated on
  both ranks and for the one split over them. Every token's projections are
  computed alone, on the one path every row count takes; the KV
  all-gather moves bytes; and a split row's chunks take the attention kernel
  the whole row takes on one rank, which gives a query the same bits
  whichever queries share its call. (Before that, a split prompt's ~1e-6
  rounding differences were amplified by the int8 activations to whole
  tokens: one activation landing across a rounding boundary moves a
  projection by a step of its block.)
"""

from __future__ import annotations

import os

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.layers.quant_linear import QuantParts, QuantWeight
from helpers.procs import shm_mappings

pytestmark = pytest.mark.multiprocess  # the P = 2 run starts rank processes

PROMPTS = [
    "The capital of France is",  # short: prefilled by the integer kernel too
    "def fibonacci(n):\n    ",
    "Context parallelism splits one long prompt across several ranks, so that the time to the first "
    "token falls with the number of ranks while the answer stays the same. Explain how the prompt is "
    "split, why each rank gets an early and a late chunk, and what the ranks exchange in each layer. " * 3,
]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=0)
TOL = 0.5
GAP = 1.0


def mapped_files(pid: int) -> set[str]:
    """The files pid maps (ctxpar's shared segments, the GGUF file, libraries)."""
    return {line.split()[5] for line in open(f"/proc/{pid}/maps") if len(line.split()) >= 6}


def in_shared_pages(llm: LLM, weight: QuantWeight | QuantParts) -> bool:
    """Whether every tensor of `weight` lies in a file that rank 1 maps too: the GGUF file
    itself where its blocks are read in place, else the ranks' shared segment."""
    [worker] = llm.engine.executor.procs
    shared = mapped_files(os.getpid()) & mapped_files(worker.pid)
    assert any(name.startswith("/dev/shm/ctxpar-") for name in shm_mappings(worker.pid))  # Q and K's copies
    spans = [
        (int(line.split()[0].split("-")[0], 16), int(line.split()[0].split("-")[1], 16))
        for line in open(f"/proc/{os.getpid()}/maps")
        if len(line.split()) >= 6 and line.split()[5] in shared
    ]
    parts = weight.parts if isinstance(weight, QuantParts) else [weight]
    return all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for w in parts for t in w.tensors())


@pytest.fixture(scope="module")
def outputs() -> dict[tuple[str, int], list]:
    out: dict = {}
    for quantization, pcp_size in [("none", 1), ("gguf", 1), ("gguf", 2)]:
        # A float32 cache on both sides: TOL and GAP bound the int8 activations' error; the int8
        # cache a kept GGUF gets by default adds its own (worst prompt logprob 0.51 against 0.28;
        # its perplexity: docs/benchmarks.md, "Quantized KV caches with turned heads").
        kwargs = dict(quantization=quantization, kv_cache_dtype="model", pcp_size=pcp_size, pcp_min_tokens=64)
        with LLM(max_model_len=1024, **kwargs) as llm:
            model = llm.engine.loaded.model
            if pcp_size == 1:
                kinds = {type(model.embed_tokens), type(model.layers[0].mlp.down_weight)}
                assert (QuantWeight in kinds) == (quantization == "gguf"), kinds
            elif llm.engine.executor.group.shm is not None:  # ranks on one host: one copy of the blocks
                weights = (model.lm_head, model.layers[7].mlp.down_weight, model.layers[3].self_attn.qkv_weight)
                out["shared"] = [in_shared_pages(llm, w) for w in weights]
            out[quantization, pcp_size] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            if (quantization, pcp_size) == ("gguf", 1):  # the fp32 path's texts, teacher-forced
                texts = [{"prompt_token_ids": [*o.prompt_token_ids, *o.outputs[0].token_ids]} for o in out["none", 1]]
                out["forced"] = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return out


def test_ranks_on_one_host_share_the_quantized_weights(outputs) -> None:
    if "shared" not in outputs:
        pytest.skip("CTXPAR_SHM=0: each rank keeps its own copy")
    assert outputs["shared"] == [True, True, True]


def test_prefill_with_int8_activations_stays_close(outputs) -> None:
    exact, quant = outputs["none", 1][2], outputs["gguf", 1][2]
    ids = exact.prompt_token_ids
    assert len(ids) >= 128  # a prefill of many rows: the same kernel as one row
    worst = max(
        abs(a[t].logprob - b[t].logprob)
        for t, a, b in zip(ids[1:], exact.prompt_logprobs[1:], quant.prompt_logprobs[1:])
    )
    assert worst < TOL, worst


def test_decode_with_int8_activations_stays_close(outputs) -> None:
    """Each path's own greedy decode: the same tokens and close logprobs until the texts
    part, which only a near tie of the fp32 path's top two may make. Where they part
    depends on the float rounding of the CPU's kernels, so every one of the fp32 path's
    tokens is then also scored by the quantized model on the fp32 path's text
    (teacher-forced, as prompt logprobs: every row takes the one integer path, so a
    prompt row computes what a decode row would): close logprobs, and its top token
    wherever the fp32 path's top two are GAP apart."""
    for exact, quant in zip(outputs["none", 1], outputs["gguf", 1]):
        a, b = exact.outputs[0], quant.outputs[0]
        for k, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            lp = a.logprobs[k]
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < GAP, f"token {k}: {ta} vs {tb} with a gap of {top[0] - top[1]:.2f}"
                break  # the texts part here: later tokens have different contexts
            assert abs(lp[ta].logprob - b.logprobs[k][tb].logprob) < TOL
    assert outputs["gguf", 1][0].outputs[0].text.strip().startswith("Paris")
    for exact, forced in zip(outputs["none", 1], outputs["forced"]):
        start, a = len(exact.prompt_token_ids), exact.outputs[0]
        for k, t in enumerate(a.token_ids):
            top = sorted((v.logprob for v in a.logprobs[k].values()), reverse=True)
            got = forced.prompt_logprobs[start + k]
            assert abs(got[t].logprob - a.logprobs[k][t].logprob) < TOL, (k, got[t], a.logprobs[k][t])
            assert top[0] - top[1] < GAP or got[t].rank == 1, (k, got, a.logprobs[k])


def test_two_ranks_equal_one_rank(outputs) -> None:
    for i, (one, two) in enumerate(zip(outputs["gguf", 1], outputs["gguf", 2])):
        a, b = one.outputs[0], two.outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text, f"prompt {i}"
        assert b.logprobs == a.logprobs and two.prompt_logprobs == one.prompt_logprobs, f"prompt {i}"
    assert any(len(o.prompt_token_ids) >= 64 for o in outputs["gguf", 1])  # pcp_min_tokens: one prompt is split
