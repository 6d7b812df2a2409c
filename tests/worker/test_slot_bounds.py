"""The C++ kernels index the KV cache with the step plan's slots unchecked, so the
model runner bounds every slot of a step once, before any kernel runs: a plan
naming a block outside the cache, or a table too short for the step's
positions, is refused instead of reading or writing out of bounds. The check is
code, not an ``assert``: it holds under ``python -O`` too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ctxpar import LLM
from ctxpar.worker.step_inputs import check_block_tables
from ctxpar.worker.step_plan import StepPlan


def plan(table: list[int], computed: int = 0, scheduled: int = 1) -> StepPlan:
    """One prefilling row of ``scheduled`` tokens after ``computed`` cached ones."""
    return StepPlan(
        input_ids=np.ones(scheduled, dtype=np.int64),
        num_scheduled_tokens=np.array([scheduled]),
        num_computed_tokens=np.array([computed]),
        is_prefilling=np.array([True]),
        needs_logits=np.array([True]),
        block_tables=[np.array(table, dtype=np.int64)],
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    """A tiny Llama whose KV cache is quantized: its writes go through a C++ kernel."""
    with LLM(str(tiny_model_dirs["llama"]), device="cpu", kv_cache_dtype="int8", num_kv_blocks=32) as llm:
        yield llm


@pytest.mark.parametrize(
    "bad, match",
    [
        (plan([32]), "block id 32 outside the KV cache's 32 blocks"),  # one past the end
        (plan([1 << 40]), "outside the KV cache"),  # far past it
        (plan([-1]), "block id -1 outside"),
        (plan([0], computed=30, scheduled=3), "holds 16 slots, the step uses 33"),  # positions past the table
    ],
)
def test_a_plan_out_of_the_cache_is_refused_before_any_kernel(llm, bad, match, monkeypatch) -> None:
    runner = llm.engine.executor.runner.target
    monkeypatch.setattr(runner.model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    before = runner.kv_stack.clone()
    with pytest.raises(ValueError, match=match):
        runner.execute(bad)
    assert (runner.kv_stack == before).all()


def test_a_plan_in_the_cache_runs(llm) -> None:
    runner = llm.engine.executor.runner.target
    out = runner.execute(plan([7, 3], computed=10, scheduled=20))
    assert out is not None and out.logits.shape[0] == 1


def test_the_check_holds_under_python_O(tmp_path: Path) -> None:
    """``python -O`` removes asserts; the slot check and the kernels' layout checks stay."""
    script = tmp_path / "check.py"
    script.write_text(
        "import numpy as np, torch\n"
        "from ctxpar.kernels import attention_kernels as attn_kernels\n"
        "from ctxpar.worker.step_inputs import check_block_tables\n"
        "refused = 0\n"
        "try:\n"
        "    check_block_tables([np.array([9])], np.array([1]), 16, 8)\n"
        "except ValueError:\n"
        "    refused += 1\n"
        "try:\n"
        "    attn_kernels.prefill_attention(*(torch.zeros(4, 2, 16) for _ in range(3)), 1.0, out=torch.zeros(1))\n"
        "except ValueError:\n"
        "    refused += 1\n"
        "print(__debug__, refused)\n"
    )
    result = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "2"]


def test_check_block_tables_bounds_every_slot() -> None:
    check_block_tables([np.array([0, 7]), np.array([], dtype=np.int64)], np.array([32, 0]), 16, 8)
    with pytest.raises(ValueError, match="row 1's block table holds 0 slots, the step uses 1"):
        check_block_tables([np.array([0, 7]), np.array([], dtype=np.int64)], np.array([32, 1]), 16, 8)
    with pytest.raises(ValueError, match="block ids must be integers"):
        check_block_tables([np.array([0.5])], np.array([1]), 16, 8)
