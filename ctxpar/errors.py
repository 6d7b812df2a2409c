"""User-facing errors.

A ``CtxparError`` is a mistake the user can fix (bad value, missing file). The
CLI prints its message without a traceback and exits non-zero; library callers
get a normal exception that is also a ``ValueError``.
"""


class CtxparError(ValueError):
    """A user error: the message names the problem and how to fix it."""
