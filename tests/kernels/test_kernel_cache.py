"""The kernel library is loaded (and so run) only from a directory and a file that
are this user's and writable by nobody else. Each test plants a library whose
constructor would create a file, where another user could put it, and checks
that the engine refuses it, says why, never runs it, and builds its own in a
fresh private directory."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxpar import kernels

OTHER_UID = 12345  # a user other than the test's (CI runs as root, which may chown)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cached_cxx: str) -> Iterator[Path]:
    """The library not yet loaded, the cache in tmp_path/cache, the system's
    temporary directory tmp_path/tmp; yields tmp_path. Each test's build runs
    through ``cached_cxx``: g++ once, its library copied for the next tests."""
    monkeypatch.setenv("CXX", cached_cxx)
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    kernels._library.cache_clear()
    yield tmp_path
    kernels._library.cache_clear()


def plant_library(path: Path, marker: Path) -> None:
    """An attacker's library at ``path``: loading it creates ``marker``."""
    source = path.parent / "evil.cpp"
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void run(void) "
        f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    subprocess.run([os.environ.get("CXX", "g++"), "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()
    os.chmod(path, 0o777)


def library_name() -> str:
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    return kernels._library_name([*kernels.FLAGS, "-march=native"], version)


def loaded_from(tmp_path: Path, planted: Path | None = None) -> Path:
    """The one library built for this test: in a private directory under the temporary one."""
    [built] = [p for p in (tmp_path / "tmp").glob("ctxpar-kernels-*/ctxpar_kernels-*.so") if p.parent != planted]
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    return built


def test_world_writable_cache_directory_is_refused(fresh: Path) -> None:
    shared = fresh / "cache" / "kernels"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)  # e.g. made by another user for everyone
    marker = fresh / "ran"
    plant_library(shared / library_name(), marker)
    with pytest.warns(UserWarning, match=r"not using the cache directory .*kernels: it can be written by .*0777"):
        lib = kernels._library()
    assert lib is not None and lib.linear_panel_width() > 0
    assert not marker.exists()
    assert loaded_from(fresh).name == library_name()


def test_library_of_another_user_is_refused(fresh: Path) -> None:
    """The directory is private, but the library in it belongs to someone else."""
    private = fresh / "cache" / "kernels"
    private.mkdir(parents=True, mode=0o700)
    marker = fresh / "ran"
    plant_library(private / library_name(), marker)
    os.chown(private / library_name(), OTHER_UID, OTHER_UID)
    os.chmod(private / library_name(), 0o755)
    with pytest.warns(UserWarning, match=rf"not using the kernel library .*: it belongs to uid {OTHER_UID}"):
        assert kernels._library() is not None
    assert not marker.exists()
    loaded_from(fresh)


def test_symlinked_library_is_refused(fresh: Path) -> None:
    private = fresh / "cache" / "kernels"
    private.mkdir(parents=True, mode=0o700)
    marker = fresh / "ran"
    plant_library(fresh / "elsewhere.so", marker)
    os.chmod(fresh / "elsewhere.so", 0o700)
    (private / library_name()).symlink_to(fresh / "elsewhere.so")
    with pytest.warns(UserWarning, match="is a symbolic link"):
        assert kernels._library() is not None
    assert not marker.exists()


def test_the_old_predictable_fallback_is_never_read(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cache unwritable, the fallback is a fresh mkdtemp directory: a
    directory planted at the name older versions used (``ctxpar-kernels-<uid>``)
    is not looked at."""
    (fresh / "file").write_text("")
    monkeypatch.setenv("CTXPAR_CACHE", str(fresh / "file" / "cache"))  # under a regular file: cannot be created
    planted = fresh / "tmp" / f"ctxpar-kernels-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    marker = fresh / "ran"
    plant_library(planted / library_name(), marker)
    assert kernels._library() is not None
    assert not marker.exists()
    loaded_from(fresh, planted)


def test_built_library_and_directories_are_private(fresh: Path) -> None:
    """What ctxpar creates (cache root, kernels directory, library) only its user can write,
    whatever the umask."""
    old = os.umask(0o002)
    try:
        assert kernels._library() is not None
    finally:
        os.umask(old)
    [library] = (fresh / "cache" / "kernels").glob("ctxpar_kernels-*.so")
    for path in (fresh / "cache", fresh / "cache" / "kernels", library):
        assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0, path
