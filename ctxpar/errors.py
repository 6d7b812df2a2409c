"""User-facing errors.

A ``CtxparError`` is a mistake the user can fix (bad value, missing file). The
CLI prints its message without a traceback and exits 2; library callers get a
normal exception that is also a ``ValueError``. A ``RankFailure`` is a runtime
failure of the ranks (the CLI exits 1). Both live here, free of torch, so the
CLI can catch them without importing it.
"""


class CtxparError(ValueError):
    """A user error: the message names the problem and how to fix it."""


class RankFailure(RuntimeError):
    """A PCP rank died, hung or could not be reached: the engine cannot
    continue. Not the user's input: the CLI exits 1 (a CtxparError exits 2)."""


class RanksStopped(RankFailure):
    """The ranks were stopped after an earlier failure (or an interrupt): there is
    nothing left to recover; create a new engine."""
