"""Scripted, teacher-forced steps for comparing P ranks against one rank.

The plans are written here by hand, not by the scheduler, so one script can
put every kind of row in a single step: decodes, fresh prefills, continued
chunked prefills and prompts shorter than 2P. Token ids are fixed (teacher
forcing), so the logits of every step are comparable across rank counts.
"""

from __future__ import annotations

import numpy as np
import torch

from ctxpar.config import EngineConfig
from ctxpar.worker.step_plan import StepPlan

BLOCK_SIZE = 4
BLOCKS_PER_REQUEST = 40  # each request owns a disjoint, scrambled range of blocks


def _blocks(req: int) -> np.ndarray:
    ids = np.arange(req * BLOCKS_PER_REQUEST, (req + 1) * BLOCKS_PER_REQUEST, dtype=np.int64)
    return np.random.default_rng(req).permutation(ids)  # non-contiguous, like a real allocator's


# The default script: five steps over requests 0..5, (req, num_tokens) per row, and each request's prompt length.
PROMPT_LEN = {0: 37, 1: 5, 2: 60, 3: 19, 4: 3, 5: 50}
STEPS = [
    [(0, 37), (1, 5), (2, 24)],  # two fresh prefills (one shorter than 2P) + a first chunk
    [(0, 1), (1, 1), (2, 36), (3, 19)],  # decodes + a continued chunk + a fresh prefill
    [(3, 1), (0, 1), (2, 1), (4, 3), (1, 1)],  # decodes, a 3-token prompt
    [(5, 20), (4, 1), (0, 1)],  # a first chunk with decodes
    [(5, 30), (3, 1), (2, 1)],  # the rest of it
]


def scripted_plans(
    vocab: int,
    seed: int = 0,
    prompt_len: dict[int, int] = PROMPT_LEN,
    steps: list[list[tuple[int, int]]] = STEPS,
    same_tokens: dict[int, int] | None = None,
) -> list[StepPlan]:
    """One StepPlan per step of ``steps`` (rows of (request, tokens computed), in
    order); a request computes its prompt (``prompt_len``) and then decodes.
    same_tokens: {request: an earlier request whose token ids it repeats}."""
    rng = np.random.default_rng(seed)
    tokens = {r: rng.integers(0, vocab, size=n + 8).tolist() for r, n in prompt_len.items()}
    tokens.update({r: tokens[other] for r, other in (same_tokens or {}).items()})
    computed = {r: 0 for r in prompt_len}
    plans = []
    for rows in steps:
        ids, q, c, pre, logits, tables = [], [], [], [], [], []
        for r, n in rows:
            start = computed[r]
            ids += tokens[r][start : start + n]
            q.append(n)
            c.append(start)
            pre.append(start < prompt_len[r])
            logits.append(start + n >= prompt_len[r])
            tables.append(_blocks(r))
            computed[r] = start + n
        plans.append(
            StepPlan(
                input_ids=np.array(ids, dtype=np.int64),
                num_scheduled_tokens=np.array(q, dtype=np.int64),
                num_computed_tokens=np.array(c, dtype=np.int64),
                is_prefilling=np.array(pre),
                needs_logits=np.array(logits),
                block_tables=tables,
            )
        )
    return plans


def run_plans(
    model: str, plans: list[StepPlan], pcp_size: int, pcp_min_tokens: int = 0, **config_kwargs
) -> list[torch.Tensor]:
    """Run the plans on `pcp_size` real ranks; rank 0's logits of every step.
    config_kwargs: more EngineConfig fields (e.g. pcp_spread_min_rows)."""
    from ctxpar.executor import start_executor

    config_kwargs.setdefault("max_model_len", BLOCKS_PER_REQUEST * BLOCK_SIZE)  # a request's own blocks
    config = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        pcp_size=pcp_size,
        pcp_min_tokens=pcp_min_tokens,
        num_threads=1,
        num_kv_blocks=BLOCKS_PER_REQUEST * 6,
        **config_kwargs,
    )
    executor = start_executor(config)
    try:
        return [executor.execute(plan).logits.clone() for plan in plans]
    finally:
        executor.close()


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Every step's logits within 1e-5 of the reference's."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"step {step}"
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=lambda m: f"step {step}: {m}")


def four_families(tiny_model_dirs: dict, root) -> dict[str, str]:
    """Tiny Llama and Qwen3 (GQA) and DeepSeek-V2 / V3 (MLA) model directories, by name."""
    from helpers.deepseek_configs import tiny_deepseek_configs
    from helpers.models import save_tiny_model

    dirs = {name: str(tiny_model_dirs[name]) for name in ("llama", "qwen3")}
    ds = tiny_deepseek_configs()
    dirs["deepseek_v2"] = str(save_tiny_model(ds["v2_group_yarn"], root / "v2"))
    dirs["deepseek_v3"] = str(save_tiny_model(ds["v3"], root / "v3"))
    return dirs
