"""ctxpar makes PyTorch's OpenMP threads wait passively unless the user chose
otherwise (ctxpar/__init__.py): libgomp reads OMP_WAIT_POLICY once, when torch
loads, so it must be set before torch's first import. Checked in fresh
interpreters, as a user's script or a spawned rank would start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The policy torch's OpenMP runtime saw when it loaded (after ctxpar, as in a script).
PROBE = "import os, ctxpar, torch; from ctxpar import LLM; print(os.environ.get('OMP_WAIT_POLICY'))"


def _probe(env_policy: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_passive_by_default():
    assert _probe(None) == ["PASSIVE"]


@pytest.mark.parametrize("policy", ["ACTIVE", "passive"])
def test_user_choice_wins(policy):
    assert _probe(policy) == [policy]
