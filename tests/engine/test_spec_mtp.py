"""Speculative decoding with a DeepSeek-V3 checkpoint's multi-token-prediction layer
(method "mtp"): every draft is what transformers' own modules compute for that layer
(tests/helpers/mtp.py), across chunked prefill, rejections and preemptions; the
tokens are exactly those without speculation, on one rank and split across ranks
under DCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model
from helpers.mtp import MTPReference, add_mtp_layer
from helpers.workloads import SMALL

MTP = {"method": "mtp", "num_speculative_tokens": 3}
MP = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    target = save_tiny_model(tiny_deepseek_configs()["v3"], root / "v3")
    return {"target": target, "mtp": add_mtp_layer(target, root / "v3_mtp")}


def workload(n: int = 6) -> tuple[list[dict], list[SamplingParams]]:
    """Greedy prompts of 3 to 40 tokens, a short repeated phrase in some (drafts often right)."""
    import numpy as np

    rng = np.random.default_rng(1)
    prompts, params = [], []
    for i in range(n):
        if i % 2 == 0:
            prompt = (rng.integers(0, 256, 4).tolist() * 10)[: int(rng.integers(8, 40))]
        else:
            prompt = rng.integers(0, 256, int(rng.integers(3, 30))).tolist()
        prompts.append({"prompt_token_ids": prompt})
        params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(10, 30)), ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference(dirs) -> list:
    prompts, params = workload()
    with LLM(str(dirs["mtp"]), **SMALL) as llm:  # the target alone: its MTP layer is ignored
        return llm.generate(prompts, params, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_drafts_are_the_layers_and_tokens_unchanged(dirs, reference):
    """Every proposal (chunked prefills caught up across steps, rejected drafts' KV
    rewritten, preempted requests started over) equals the reference's drafts."""
    prompts, params = workload()
    seen: list[tuple[list[int], list[int]]] = []
    kwargs = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=80)
    with LLM(str(dirs["mtp"]), speculative_config=MTP, **kwargs) as llm:
        proposer = llm.engine.spec.draft_model
        propose = proposer.propose

        def recording(drafting, running):
            propose(drafting, running)
            seen.extend((r.prompt_token_ids + r.output_token_ids, list(r.spec_token_ids)) for r in drafting)

        proposer.propose = recording
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert not llm.engine.config.enable_prefix_caching  # see EngineConfig: mtp computes prompts
        bm = llm.engine.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == llm.engine.num_blocks
    assert tokens(outs) == tokens(reference)
    seen = [(known, drafts) for known, drafts in seen if drafts]
    assert len(seen) > 20
    ref = MTPReference(dirs["mtp"])
    for known, drafts in seen:
        assert drafts == ref.drafts(known, len(drafts)), known
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.metrics.num_draft_tokens for o in outs)


def test_seeded_sampling_is_reproducible_and_top1_is_greedy(dirs, reference):
    prompts, params = workload()
    top1 = [SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    sampled = [SamplingParams(temperature=1.0, seed=5, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    with LLM(str(dirs["mtp"]), speculative_config=MTP, **SMALL) as llm:
        assert tokens(llm.generate(prompts, top1, use_tqdm=False)) == tokens(reference)
        first = tokens(llm.generate(prompts, sampled, use_tqdm=False))
        assert first == tokens(llm.generate(prompts, sampled, use_tqdm=False))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(pcp_size=2, dcp_size=2, pcp_min_tokens=0), marks=MP, id="P2-DCP-split"),
        pytest.param(dict(pcp_size=3, pcp_min_tokens=8), marks=MP, id="P3-mixed"),
    ],
)
def test_greedy_identical_across_ranks(dirs, reference, kwargs):
    """The layer's catch-up rows split across the ranks like any row, its KV sharded under DCP."""
    prompts, params = workload()
    with LLM(str(dirs["mtp"]), speculative_config=MTP, max_num_batched_tokens=32, **SMALL, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(reference)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_a_checkpoint_without_the_layer_is_refused(dirs):
    with pytest.raises(CtxparError, match="no next-token-prediction layer"):
        LLM(str(dirs["target"]), speculative_config=MTP)
