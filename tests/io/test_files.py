"""Saves behave like the tools people trust (issue 21): through symbolic links, keeping the
target's permissions, refusing read-only files, with any name the filesystem allows."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fslr_func.io.atomic import atomic_write_text, write_json
from fslr_func.io.record import FSLRRecord


def _record(n: int) -> FSLRRecord:
    return FSLRRecord(steps=list(range(n)), fslr={"w": [0.5] * n}, meta={"base_lr": 0.1})


def test_save_through_symbolic_links_replaces_the_target(tmp_path: Path) -> None:
    real = tmp_path / "data" / "base.json"
    real.parent.mkdir()
    _record(1).save(real)
    (tmp_path / "link1.json").symlink_to("data/base.json")  # relative
    (tmp_path / "link2.json").symlink_to(tmp_path / "link1.json")  # a chain
    _record(3).save(tmp_path / "link2.json")
    assert (tmp_path / "link1.json").is_symlink() and (tmp_path / "link2.json").is_symlink()
    assert len(FSLRRecord.load(real)) == 3  # the target, not a stale copy
    assert sorted(os.listdir(real.parent)) == ["base.json"]  # the temporary file went there
    # a dangling link: the file it names is created
    (tmp_path / "dangling.json").symlink_to("data/new.json")
    _record(2).save(tmp_path / "dangling.json")
    assert len(FSLRRecord.load(real.parent / "new.json")) == 2


def test_save_keeps_the_permissions_and_refuses_a_read_only_file(tmp_path: Path) -> None:
    path = tmp_path / "base.json"
    _record(1).save(path)
    os.chmod(path, 0o640)
    _record(2).save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    for mode in (0o444, 0o400):
        os.chmod(path, mode)
        before = path.read_bytes()
        with pytest.raises(PermissionError, match=rf"cannot write '{path}': .*read-only.*chmod"):
            _record(5).save(path)
        with pytest.raises(PermissionError, match="read-only"):
            write_json(path, {})
        assert path.read_bytes() == before and os.listdir(tmp_path) == ["base.json"]
    os.chmod(path, 0o600)
    _record(5).save(path)
    assert len(FSLRRecord.load(path)) == 5


def test_a_new_file_gets_the_umask_without_the_umask_being_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mode of a new file was found by setting the umask to 0 and back: another thread
    saving in between created a world-writable file and left the process at umask 0."""
    previous = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was set"))
        _record(1).save(tmp_path / "new.json")
        write_json(tmp_path / "new2.json", {})
    finally:
        monkeypatch.undo()
        os.umask(previous)
    for name in ("new.json", "new2.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640


def test_the_temporary_file_is_opened_binary_and_not_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.open`` opens in text mode on Windows unless told ``O_BINARY`` (every ``\\n`` of a
    checkpoint would become ``\\r\\n``); ``tempfile.mkstemp``, used before, added it and
    ``O_NOFOLLOW``. Windows' flag value is set here, where the system lacks it."""
    flags: list[int] = []
    real_open = os.open
    monkeypatch.setattr(os, "O_BINARY", 0x8000, raising=False)
    monkeypatch.setattr(
        os, "open", lambda path, f, *a: flags.append(f) or real_open(path, f & ~0x8000, *a)
    )
    _record(1).save(tmp_path / "base.json")
    created = [f for f in flags if f & os.O_CREAT]
    assert created and all(f & 0x8000 and f & os.O_NOFOLLOW for f in created)


@pytest.mark.parametrize("length", [200, 245, 250, 255])
@pytest.mark.parametrize("char", ["a", "é", "日"])  # 1, 2 and 3 bytes in UTF-8
def test_any_name_the_filesystem_allows(tmp_path: Path, length: int, char: str) -> None:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    stem = char * ((min(length, limit) - len(".json")) // len(char.encode()))
    path = tmp_path / f"{stem}.json"
    assert len(path.name.encode()) <= limit
    _record(1).save(path)
    _record(2).save(path)
    assert len(FSLRRecord.load(path)) == 2 and os.listdir(tmp_path) == [path.name]
    atomic_write_text(tmp_path / f"{stem}.csv", "x")  # a neighbour with the same long stem
    assert (tmp_path / f"{stem}.csv").read_text() == "x"


def test_a_name_past_the_limit_is_the_filesystems_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / ("a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1))
    with pytest.raises(OSError, match=r"cannot write .*File name too long") as info:
        _record(1).save(path)
    assert ".tmp" not in str(info.value)


def test_a_path_ending_in_a_separator_names_a_folder(tmp_path: Path) -> None:
    for folder in (tmp_path / "new", tmp_path / "existing"):  # "runs/base/", made or not
        if folder.name == "existing":
            folder.mkdir()
        with pytest.raises(IsADirectoryError, match=rf"cannot write '{folder}/'"):
            _record(1).save(f"{folder}/")
        with pytest.raises(IsADirectoryError):
            write_json(f"{folder}/", {}, parents=True)
    assert sorted(os.listdir(tmp_path)) == ["existing"]  # no file named after the folder
