"""A compiler that remembers: the tests that make the kernel library build again (in a
fresh private directory, after refusing a planted one) would otherwise each run the
same seconds-long g++ build of the same sources with the same flags.

``write_cached_compiler`` writes an executable to stand as ``$CXX``: the engine calls it
as it calls g++; it runs g++ itself, and for a command it has already seen (the same
arguments but ``-o``, the same contents of every file named and of the headers beside
them) it writes g++'s earlier output to the new ``-o`` instead, as ccache does.
``--version`` and any command without ``-o`` go to g++ unchanged, so the library's name
(which hashes g++'s version) is g++'s. ``keep`` stores an output g++ made elsewhere (the
library the session has already built) under its command."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

_SCRIPT = """\
import sys
sys.path.insert(0, {here!r})
from compiler_cache import main
main({cxx!r}, {store!r}, sys.argv[1:])
"""


def _key(cxx: str, args: list[str]) -> str:
    """What g++'s output depends on: the command but its ``-o``, and the files it reads."""
    at = args.index("-o")
    rest = args[:at] + args[at + 2 :]
    key = hashlib.sha256(repr([cxx, rest]).encode())
    for arg in rest:
        if os.path.isfile(arg):
            for path in [Path(arg), *sorted(Path(arg).parent.glob("*.h"))]:
                key.update(str(path).encode() + b"\0" + path.read_bytes())
    return key.hexdigest()


def keep(store: Path, cxx: str, args: list[str], output: Path) -> None:
    """Store ``output``, which ``cxx args`` wrote to ``args``' ``-o``, for that command."""
    tmp = store / f"{_key(cxx, args)}.{os.getpid()}"
    shutil.copyfile(output, tmp)
    os.replace(tmp, store / _key(cxx, args))


def main(cxx: str, store: str, args: list[str]) -> None:
    """The compiler's command line: ``cxx args``, or the output it gave for them before."""
    if "-o" not in args:
        os.execvp(cxx, [cxx, *args])
    kept = Path(store) / _key(cxx, args)
    if kept.is_file():
        shutil.copyfile(kept, args[args.index("-o") + 1])
        sys.exit(0)
    done = subprocess.run([cxx, *args])
    if done.returncode == 0:
        keep(Path(store), cxx, args, Path(args[args.index("-o") + 1]))
    sys.exit(done.returncode)


def write_cached_compiler(store: Path, cxx: str = "g++") -> Path:
    """An executable in ``store`` that compiles as ``cxx`` does, keeping its outputs in
    ``store`` to give them again for the same command and inputs."""
    path = store / "cxx"
    script = _SCRIPT.format(here=str(Path(__file__).parent), cxx=cxx, store=str(store))
    path.write_text(f"#!{sys.executable}\n{script}")
    os.chmod(path, stat.S_IRWXU)
    return path
