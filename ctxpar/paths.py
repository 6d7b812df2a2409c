"""Where ctxpar keeps what it builds or converts once: ``$CTXPAR_CACHE``, else
``~/.cache/ctxpar`` (compiled kernels in ``kernels/``, converted GGUF files in ``gguf/``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CTXPAR_CACHE") or "~/.cache/ctxpar").expanduser()
