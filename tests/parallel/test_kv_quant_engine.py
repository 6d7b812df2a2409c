"""A quantized KV cache across ranks: greedy tokens at P = 2 (PCP's all-gather
moves the quantized rows) and under DCP (P = D = 2, the rows sharded) equal one
rank's with the same kv_cache_dtype, through chunked prefill, split and
replicated rows and prefix-cache hits; GQA and MLA's latent cache. Quantizing
is per token, so every rank stores the same bytes whichever rank computed them."""

from __future__ import annotations

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.entrypoints.cli.generate import _describe
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENGINE = dict(block_size=8, max_num_batched_tokens=64, max_model_len=256)


def prompts() -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(0, 256, size=n).tolist()} for n in (150, 3, 70, 20)]


def generate(llm: LLM, ps: list[dict]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kv_quant_engine")
    return {
        "llama": str(tiny_model_dirs["llama"]),
        "deepseek_v3": str(save_tiny_model(tiny_deepseek_configs()["v3"], root / "v3")),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, kv_cache_dtype, ranks",
    [
        ("llama", "int8", dict(pcp_size=2, pcp_min_tokens=0)),  # a full cache per rank: PCP's all-gather
        ("llama", "fp8", dict(pcp_size=2, dcp_size=2, pcp_min_tokens=50)),  # sharded, split and replicated rows
        ("deepseek_v3", "int8", dict(pcp_size=2, dcp_size=2, pcp_min_tokens=50)),  # MLA's latents sharded
    ],
)
def test_ranks_generate_what_one_rank_does(models, model, kv_cache_dtype, ranks, capsys) -> None:
    with LLM(models[model], kv_cache_dtype=kv_cache_dtype, **ENGINE) as llm:
        want = generate(llm, prompts())
    with LLM(models[model], kv_cache_dtype=kv_cache_dtype, **ENGINE, **ranks) as llm:
        assert generate(llm, prompts()) == want
        hits = llm.engine.scheduler.prefix_cache_stats.hits
        assert generate(llm, prompts()[::2]) == want[::2]  # the prompts' full blocks: prefix-cache hits
        assert llm.engine.scheduler.prefix_cache_stats.hits > hits
        _describe(llm, 0.0)
    assert f"KV cache ({kv_cache_dtype})" in capsys.readouterr().err
