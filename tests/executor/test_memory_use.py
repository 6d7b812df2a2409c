"""What `ctxpar generate --verbose` reports of a rank's memory (ctxpar.machine.memory_use):
the kernel's own accounting, and it moves with what the process touches."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

from ctxpar.machine import memory_use


def test_resident_is_its_parts_and_grows_with_touched_memory() -> None:
    before = memory_use(os.getpid())
    assert before is not None and before.resident == before.anonymous + before.file_mapped + before.shared
    # 64 MiB of fresh anonymous pages, every one written (an allocator could instead hand
    # back memory a test before freed but kept resident, which would not grow the count).
    held = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(0, len(held), mmap.PAGESIZE):
        held[page] = 1
    after = memory_use(os.getpid())
    assert after is not None and after.anonymous - before.anonymous >= 60 << 20
    held.close()


def test_a_process_that_is_gone_reads_as_none() -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert memory_use(int(proc.stdout)) is None
