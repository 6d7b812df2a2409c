"""Every ctypes signature (ctxpar/kernels/signatures.py) against its C++: the kernels
take raw pointers and sizes, so an argument too many, too few or of the wrong width
shifts the ones after it and the kernel reads or writes where it should not, silently.

The declarations are read from the sources' ``extern "C"`` blocks, the function
definitions and the forward declarations alike, and each C type mapped to the ctypes
type that passes it: ``int64_t`` an int64, ``float`` a float, any pointer a pointer."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from ctxpar.kernels.build import SOURCES
from ctxpar.kernels.signatures import SIGNATURES

C_TYPES = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "void": None,
}
SOURCE_NAMES = ", ".join(s.name for s in SOURCES)
DECLARATION = re.compile(r"^\s*([\w\s]+?\**)\s*\b(\w+)\s*\(([^()]*)\)\s*[{;]", re.MULTILINE)


def _without_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.DOTALL)


def _extern_c_top_level(text: str) -> str:
    """The text directly inside the file's ``extern "C" { ... }`` blocks: function
    bodies (deeper braces) left out, so only declarations and definitions' heads remain."""
    kept: list[str] = []
    for opening in re.finditer(r'extern\s+"C"\s*\{', text):
        depth, i = 1, opening.end()
        while depth and i < len(text):
            ch = text[i]
            if ch == "{":
                depth += 1
                if depth == 2:
                    kept.append("{\n")  # ends the head of the definition before it
            elif ch == "}":
                depth -= 1
            elif depth == 1:
                kept.append(ch)
            i += 1
    return "".join(kept)


def _ctype(declared: str) -> type | None:
    """The ctypes type that passes one C parameter or result type."""
    declared = declared.replace("const ", "").strip()
    if declared.endswith("*") or re.search(r"\*\s*\w*$", declared):
        return ctypes.c_void_p
    base = declared.split()[0]
    if base not in C_TYPES:
        raise AssertionError(f"no ctypes mapping for the C type {declared!r}: add one to C_TYPES")
    return C_TYPES[base]


def _parameter_type(parameter: str) -> type | None:
    """``const float* q`` -> c_void_p; ``int64_t rows`` -> c_int64 (the name dropped)."""
    parameter = parameter.strip()
    pointer = "*" in parameter
    return ctypes.c_void_p if pointer else _ctype(parameter.rsplit(maxsplit=1)[0])


def exported() -> dict[str, list[tuple[type | None, list[type | None], str]]]:
    """name -> every (result type, argument types, where) declared for it in an extern "C" block."""
    found: dict[str, list[tuple[type | None, list[type | None], str]]] = {}
    for source in SOURCES:
        for match in DECLARATION.finditer(_extern_c_top_level(_without_comments(source.read_text()))):
            result, name, params = match.groups()
            params = params.strip()
            args = [] if params in ("", "void") else [_parameter_type(p) for p in params.split(",")]
            found.setdefault(name, []).append((_ctype(result), args, Path(source).name))
    return found


def test_the_parser_reads_every_source() -> None:
    """Each C++ file's exports are found (a parser that read nothing would pass the others)."""
    where = {w for decls in exported().values() for _, _, w in decls}
    assert where == {s.name for s in SOURCES}


def test_every_export_has_a_signature() -> None:
    """A function the library exports but no signature describes would be called with
    ctypes' defaults (every argument an int): each needs one."""
    assert sorted(set(exported()) - set(SIGNATURES)) == []


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_the_cpp(name: str) -> None:
    """The argument count, each argument's type and the result type are those of every
    declaration of the function in the C++ (its definition and any forward declaration)."""
    declarations = exported().get(name)
    assert declarations, f'{name} has a ctypes signature but no extern "C" declaration in {SOURCE_NAMES}'
    args, result = SIGNATURES[name]
    for declared_result, declared_args, where in declarations:
        count = f"{len(args)} ctypes arguments, {len(declared_args)} in C++"
        assert len(args) == len(declared_args), f"{name} ({where}): {count}"
        for i, (ours, theirs) in enumerate(zip(args, declared_args)):
            assert ours is theirs, f"{name} ({where}): argument {i} is {ours.__name__} in ctypes, {theirs} in C++"
        assert result is declared_result, f"{name} ({where}): result {result} in ctypes, {declared_result} in C++"
