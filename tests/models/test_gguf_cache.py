"""A converted GGUF is served from the cache only if its directory and every file
in it are this user's and writable by nobody else: its name (a hash anyone can
compute) proves nothing. Each test plants a converted model where another user
could, and checks that the engine refuses it, says why, and converts afresh
into a private directory instead of serving the planted weights."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from ctxpar.models import gguf

OTHER_UID = 12345  # a user other than the test's (CI runs as root, which may chown)


@pytest.fixture
def source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A GGUF file whose conversion (stubbed: the cache is under test, not the
    converter) writes config.json {"by": "ctxpar"} and the marker."""
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where refused conversions go
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR

    def convert(path: Path, out_dir: Path, with_weights: bool = False) -> None:
        (out_dir / "config.json").write_text(json.dumps({"by": "ctxpar"}))
        (out_dir / gguf.MARKER).write_text("{}")

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def plant(target: Path) -> None:
    """An attacker's converted model at the cache's name for the file."""
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"by": "attacker"}))
    (target / gguf.MARKER).write_text("{}")


def served(source: Path) -> tuple[Path, bool]:
    directory, temporary = gguf.gguf_to_hf_dir(source)
    assert json.loads((directory / "config.json").read_text()) == {"by": "ctxpar"}
    return directory, temporary


def test_converts_once_into_a_private_directory(source: Path) -> None:
    old = os.umask(0o002)  # the converter's files would be group-writable
    try:
        first, temporary = served(source)
    finally:
        os.umask(old)
    assert not temporary and first == gguf.cache_dir_for(source)
    for path in [first.parent.parent, first.parent, first, *first.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0, path
    assert served(source) == (first, False)  # the next load reads the cache


def test_converted_model_of_another_user_is_refused(source: Path, tmp_path: Path) -> None:
    target = gguf.cache_dir_for(source)
    plant(target)
    for path in (target, *target.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.warns(UserWarning, match=rf"not using the converted model .*: .* belongs to uid {OTHER_UID}"):
        directory, temporary = served(source)
    assert temporary and directory.parent == tmp_path / "tmp"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_group_or_world_writable_converted_model_is_refused(source: Path, mode: int) -> None:
    target = gguf.cache_dir_for(source)
    plant(target)
    os.chmod(target, mode)
    with pytest.warns(UserWarning, match=f"can be written by .*mode {mode:04o}"):
        directory, temporary = served(source)
    assert temporary and directory != target


def test_a_writable_file_in_the_converted_model_is_refused(source: Path) -> None:
    """The directory is private, but a file in it could have been changed by others."""
    target = gguf.cache_dir_for(source)
    plant(target)
    os.chmod(target / "config.json", 0o666)
    with pytest.warns(UserWarning, match=r"config.json can be written by its group and other users"):
        assert served(source)[1]


def test_symlinked_converted_model_is_refused(source: Path, tmp_path: Path) -> None:
    plant(tmp_path / "elsewhere")
    target = gguf.cache_dir_for(source)
    target.parent.mkdir(parents=True)
    target.symlink_to(tmp_path / "elsewhere")
    with pytest.warns(UserWarning, match="is a symbolic link"):
        assert served(source)[1]


def test_shared_cache_root_is_refused(source: Path, tmp_path: Path) -> None:
    """A $CTXPAR_CACHE that other users can write (they could swap any entry in it)."""
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    plant(gguf.cache_dir_for(source))
    with pytest.warns(UserWarning, match=r"not using the cache directory .*cache: it can be written by"):
        assert served(source)[1]
