"""Every choice the PCP policy can make for the split prompts of a step keeps the
logits of one rank, forced through pcp_split_mode on real rank processes (gloo).

"auto" only ever picks the groups of one of the forced modes (policy.split_ranks),
and "all" is the layout of tests/parallel/test_pcp.py, so two runs cover every
kind of group: P = 2 "whole" (a lone prompt on one rank, the other idle; two and
three prompts each on one rank: what "disjoint" gives at P = 2) and P = 3
"disjoint" (two prompts over groups of two ranks and one, three prompts one each).
Under DCP (D = P) the same, for GQA and MLA (the continued chunk of step 2, with
cached context in the shards, goes to a group).
"""

from __future__ import annotations

import pytest

from helpers.pcp_harness import assert_same_logits, four_families, run_plans, scripted_plans

pytestmark = pytest.mark.multiprocess

# Split prompts per step (pcp_min_tokens=4): three fresh ones; a continued chunk (cached
# context) beside a fresh prompt and decodes; a lone prompt beside decodes and a short one.
PROMPT_LEN = {0: 37, 1: 30, 2: 60, 3: 19, 4: 3, 5: 21}
STEPS = [
    [(0, 37), (1, 30), (2, 24)],
    [(0, 1), (1, 1), (2, 36), (3, 19)],
    [(3, 1), (4, 3), (5, 21), (2, 1)],
]


@pytest.mark.parametrize(("pcp_size", "mode"), [(2, "whole"), (3, "disjoint")])
def test_split_mode_keeps_logits(pcp_size, mode, tiny_model_dirs):
    model, plans = str(tiny_model_dirs["llama"]), scripted_plans(vocab=256, prompt_len=PROMPT_LEN, steps=STEPS)
    got = run_plans(model, plans, pcp_size, pcp_min_tokens=4, pcp_split_mode=mode)
    assert_same_logits(got, run_plans(model, plans, pcp_size=1))


@pytest.fixture(scope="module")
def families(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    return four_families(tiny_model_dirs, tmp_path_factory.mktemp("split_mode_models"))


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
@pytest.mark.parametrize(("pcp_size", "mode"), [(2, "whole"), (3, "disjoint")])
def test_split_mode_keeps_logits_under_dcp(pcp_size, mode, model, families):
    plans = scripted_plans(vocab=256, prompt_len=PROMPT_LEN, steps=STEPS)
    got = run_plans(families[model], plans, pcp_size, pcp_min_tokens=4, pcp_split_mode=mode, dcp_size=pcp_size)
    assert_same_logits(got, run_plans(families[model], plans, pcp_size=1))
