"""Structured outputs across ranks: the mask is applied where sampling happens (rank 0),
so at P = 2 and under DCP (D = 2) every output validates and has the tokens of one
rank, greedy and seeded alike. DCP merges its shards in another order than one rank,
which int8 activations can turn into another token at a near-tie (DCP's bits are its
own, not one rank's: docs/architecture.md), so it runs on the file dequantized."""

from __future__ import annotations

import pytest

from ctxpar import LLM
from ctxpar.sampling_params import SamplingParams, StructuredOutputsParams
from helpers.structured import SCHEMAS, check_json

pytestmark = pytest.mark.multiprocess  # spawns rank processes

# (schema, temperature, seed): one greedy request and one seeded sample.
REQUESTS = [("nested", 0.0, None), ("ref", 1.0, 11)]


def requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for name, temperature, seed in REQUESTS:
        # JSON with any whitespace can wander into long runs of it (greedy too: SmolLM2 with
        # its default int8 KV cache fills the nested request's 100 tokens with newlines): compact layout.
        so = StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True)
        prompts.append(f"Reply with a JSON {name}, please:")
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=100, structured_outputs=so))
    return prompts, params


_ONE_RANK: dict[str | None, list] = {}


def one_rank(quantization: str | None) -> list:
    if quantization not in _ONE_RANK:
        with LLM(dtype="float32", quantization=quantization) as llm:
            _ONE_RANK[quantization] = [o.outputs[0] for o in llm.generate(*requests(), use_tqdm=False)]
    return _ONE_RANK[quantization]


@pytest.mark.parametrize(
    ("layout", "quantization"),
    [(dict(pcp_size=2), None), (dict(pcp_size=2, dcp_size=2), "none")],
    ids=["pcp2", "pcp2-dcp2"],
)
def test_outputs_validate_and_equal_one_rank(layout, quantization):
    with LLM(dtype="float32", quantization=quantization, pcp_min_tokens=0, **layout) as llm:
        outs = [o.outputs[0] for o in llm.generate(*requests(), use_tqdm=False)]
    for (name, _, _), out, ref in zip(REQUESTS, outs, one_rank(quantization)):
        check_json(ref.text, SCHEMAS[name])
        check_json(out.text, SCHEMAS[name])
        assert out.token_ids == ref.token_ids  # greedy, and seeded sampling too: the same logits
