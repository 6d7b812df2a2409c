"""Split prefill rows under DCP that gather their cached context from the
shards (ctxpar/layers/sharded_context.py), on real ranks of one host: teacher-forced
logits equal one rank's, and the automatic choice takes each path where the
cost rule says.

The script has continued chunks after contexts longer than the 16-token
workspace (several rounds of gathering, rows packed into a round together), a
context of 2 tokens, shorter than D·I (the other ranks' shards of it are
empty), a one-token split chunk (some ranks hold none of its queries), and
decodes in the same steps (their partials are exchanged while the split rows
gather).
"""

from __future__ import annotations

import pytest
import torch

from ctxpar.errors import CtxparError
from ctxpar.layers.sharded_context import GatherPolicy, gathers_context
from helpers.dcp_harness import Job, run_groups, run_single
from helpers.pcp_harness import four_families, scripted_plans

WORKSPACE = 16
PROMPT_LEN = {0: 130, 1: 10, 2: 30, 3: 60}
STEPS = [
    [(0, 40), (1, 2), (2, 30)],  # first chunks and a whole prompt: no context yet
    [(0, 4), (1, 7), (2, 1)],  # 4 new tokens after 40, 7 after 2 (< D·I), a decode
    [(0, 60), (3, 60), (1, 1)],  # 60 after 44, a fresh prompt, one token after 9
    [(0, 26), (2, 1), (1, 1), (3, 1)],  # 26 after 104, with decodes
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # decodes only
]
# What the rule picks for the tiny Llama (4 query heads and 2 KV heads of 16, fp32) at
# P = 2 and 3: gather when (P-1)/P·C·256 bytes of context < (P-1)·n·(256 [query] + 272
# [partial]) (the partial not counted when a decode exchanges partials anyway).
# Step 1: 42 context tokens against 4-6 queries (a decode present): pass-Q by 3.5x.
# Step 2: 53 against ~41-61 queries and partials: gather by 5x. Step 3: 104 against ~10-15: pass-Q.
AUTO = {1: "pass_q", 2: "gather", 3: "pass_q"}
NUM_LAYERS = 2
MODELS = ("llama", "qwen3", "deepseek_v2")
SIZES = [2, 3]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    return four_families(tiny_model_dirs, tmp_path_factory.mktemp("dcp_gather_models"))


@pytest.fixture(scope="module")
def plans():
    return scripted_plans(vocab=256, prompt_len=PROMPT_LEN, steps=STEPS)


@pytest.fixture(scope="module")
def results(model_dirs, plans, tmp_path_factory):
    """{P: {(model, path): Result}} at P = D = 2, 3, interleave 2."""
    keys = [(m, "gather") for m in MODELS] + [("llama", "auto")]
    jobs = [Job(model_dirs[m], cp_interleave=2, context_gather=GatherPolicy(path, WORKSPACE)) for m, path in keys]
    out = run_groups(SIZES, jobs, plans, tmp_path_factory.mktemp("dcp_gather"))
    return {P: dict(zip(keys, r)) for P, r in out.items()}


@pytest.fixture(scope="module")
def single(model_dirs, plans):
    return {m: run_single(model_dirs[m], plans).logits for m in MODELS}


def assert_logits_match(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"step {step}"
        tol = 1e-5 * w.abs().max().item()
        torch.testing.assert_close(g, w, atol=tol, rtol=0, msg=lambda m: f"step {step}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("P", SIZES, ids=lambda p: f"P=D={p}")
@pytest.mark.parametrize("model", MODELS)
def test_gathered_context_logits_match_one_rank(results, single, P, model):
    result = results[P][model, "gather"]
    assert_logits_match(result.logits, single[model])
    # It did gather: steps 1-3 have split rows with context; only the decodes' partials are exchanged.
    for step in (1, 2, 3):
        assert result.collectives[step]["all_gather"] > 2 * NUM_LAYERS, f"step {step}"
    assert "all_to_all" not in result.collectives[2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("P", SIZES, ids=lambda p: f"P=D={p}")
def test_automatic_choice_takes_each_path_where_the_rule_says(results, single, P):
    result = results[P]["llama", "auto"]
    assert_logits_match(result.logits, single["llama"])
    for step, path in AUTO.items():
        done = result.collectives[step]
        # The ranks share this host: the sampled rows' hidden states go to every rank in
        # one more all-gather (each computes a range of the vocabulary).
        layer_gathers = done["all_gather"] - 1
        if path == "pass_q":  # queries in the one KV all-gather per layer, partials in one all-to-all
            assert layer_gathers == NUM_LAYERS and done["all_to_all"] == NUM_LAYERS, f"step {step}: {done}"
        else:  # the KV all-gather, then ceil(53 / 16) = 4 rounds of context per layer; no partials
            assert layer_gathers == NUM_LAYERS * (1 + 4) and "all_to_all" not in done, f"step {step}: {done}"


def test_rule_at_smollm2_shapes_matches_the_measured_crossover():
    """SmolLM2 (9 query heads, 3 KV heads of 64, fp32), a 2048-token chunk on two ranks:
    ctxpar bench dcp part (e) measured gathering faster at 2K and 4K of context and
    pass-Q faster at 8K (docs/benchmarks.md); the rule's crossover is ~6.2K."""
    q, entries = torch.empty(1024, 9, 64), torch.empty(1024, 2, 3, 64)

    def gathers(context: int, exchange_anyway: bool = False) -> bool:
        return gathers_context(GatherPolicy(), context, q, entries, 64, 2, exchange_anyway)

    assert gathers(2048) and gathers(4096) and not gathers(8192)
    # With decodes in the step the partials travel anyway: only the queries are saved.
    assert gathers(2048, True) and not gathers(4096, True)


@pytest.mark.parametrize(
    "kwargs, words",
    [(dict(path="gather_all"), ["'gather_all'", "'pass_q'"]), (dict(workspace_tokens=0), ["workspace_tokens", ">= 1"])],
)
def test_bad_policy_is_refused(kwargs, words):
    with pytest.raises(CtxparError) as e:
        GatherPolicy(**kwargs)
    for w in words:
        assert w in str(e.value)
