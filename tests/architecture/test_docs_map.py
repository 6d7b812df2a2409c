"""docs/architecture.md's folder map names every product file, and only files that exist.

The map is the code block under "## Folder layout": a line that starts with ``name/``
opens a folder, nested by its indentation; a file named on a line is that line's
folder's (``llama.py``), or for a path (``kernels/decode_loop.cpp``) the nearest
folder's, from the line's up to the package's root, where the path exists. The
product's files are ``git ls-files ctxpar`` (tracked, and new ones not ignored) that
exist: every ``.py``, ``.cpp`` and ``.h``, but an ``__init__.py`` that holds only a
docstring.

When this fails: a file added, moved or renamed under ctxpar/ needs its line in the map
(in its folder, saying its job), and a line naming a file that is gone needs removing.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import ctxpar

REPO = Path(ctxpar.__file__).parent.parent
DOC = REPO / "docs" / "architecture.md"
FILE = re.compile(r"(?<![\w./-])((?:[a-z_]+/)*[A-Za-z_][\w]*\.(?:py|cpp|h))\b")
FOLDER = re.compile(r"^(\s*)([a-z_]+)/(?:\s|$)")
NOT_FILES = {"llama.cpp"}  # names in the map that are not files: the llama.cpp project


def map_block() -> list[str]:
    """The lines of the folder map's code block."""
    text = DOC.read_text()
    section = text.split("## Folder layout", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def mapped_files() -> set[str]:
    """The files the map names, as paths from the repository's root."""
    named: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indentation, folder path) of the open folders
    for line in map_block():
        if not line.strip() or line.lstrip().startswith("--"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:  # a folder's lines are deeper than its own
            stack.pop()
        folder = FOLDER.match(line)
        if folder is not None:
            parent = stack[-1][1] + "/" if stack else ""
            stack.append((indent, parent + folder.group(2)))
            line = line[folder.end() :]
        if not stack or stack[0][1] != "ctxpar":
            break  # the map's tests/ part: not the product
        for name in set(FILE.findall(line)) - NOT_FILES:
            named.add(_resolve(name, stack[-1][1]))
    return named


def _resolve(name: str, folder: str) -> str:
    """``name`` in ``folder``, or for a path the nearest folder above where it exists."""
    if "/" in name:
        parts = folder.split("/")
        for up in range(len(parts), 0, -1):
            path = "/".join(parts[:up]) + "/" + name
            if (REPO / path).is_file():
                return path
    return f"{folder}/{name}"


def _only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) <= 1 and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def product_files() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "ctxpar"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = {f for f in out if f.endswith((".py", ".cpp", ".h")) and (REPO / f).is_file()}
    return {f for f in files if not (f.endswith("__init__.py") and _only_docstring(REPO / f))}


@pytest.fixture(scope="module")
def files() -> tuple[set[str], set[str]]:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no file list to compare with")
    return mapped_files(), product_files()


def test_every_product_file_is_in_the_map(files: tuple[set[str], set[str]]) -> None:
    mapped, product = files
    missing = sorted(product - mapped)
    assert not missing, f"docs/architecture.md's folder map does not name: {missing} (add a line for each)"


def test_every_file_the_map_names_exists(files: tuple[set[str], set[str]]) -> None:
    mapped, product = files
    gone = sorted(f for f in mapped if not (REPO / f).is_file())
    assert not gone, f"docs/architecture.md's folder map names files that do not exist: {gone}"
