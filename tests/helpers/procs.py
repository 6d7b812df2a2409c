"""What a process maps of ctxpar's shared files, read from /proc."""

from __future__ import annotations


def shm_mappings(pid: int) -> dict[str, int]:
    """pid's mappings of ctxpar's shared files: path -> bytes mapped."""
    sizes: dict[str, int] = {}
    for line in open(f"/proc/{pid}/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/dev/shm/ctxpar-"):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            sizes[fields[5]] = sizes.get(fields[5], 0) + hi - lo
    return sizes
