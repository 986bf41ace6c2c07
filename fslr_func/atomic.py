"""Atomic file writes: a reader sees the old file or the new one, never a truncated one.

Every file the library saves (records, sweep runs, summaries) goes through
:func:`atomic_write_text`: the text is written to a temporary file in the target's folder,
flushed and fsynced, given the target's permissions (an existing file's, else the umask's),
moved over the target with :func:`os.replace`, and the folder is fsynced so that the rename
survives a power cut.

Example:
    >>> import json, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_json(folder / "a" / "run.json", {"loss": 0.5}, parents=True)
    >>> json.loads((folder / "a" / "run.json").read_text())
    {'loss': 0.5}
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_text", "write_json"]


def _new_file_mode() -> int:
    """Permissions of a newly created file under the process umask (``0o666 & ~umask``)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, parents: bool = False) -> None:
    """Write ``text`` to ``path`` atomically and durably.

    Args:
        path: the target file.
        text: its new contents (UTF-8).
        parents: create missing parent folders; otherwise a missing folder is an error.

    Raises:
        OSError: the folder is missing or not writable; the message names ``path``, not the
            temporary file, and no temporary file is left behind.
    """
    target = Path(path)
    folder = target.parent.absolute()
    if parents:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.stat(target).st_mode & 0o777
    except FileNotFoundError:
        mode = _new_file_mode()
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise type(err)(err.errno, f"cannot write {os.fspath(path)!r}: {err.strerror}") from err
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def write_json(path: str | os.PathLike[str], data: Any, *, parents: bool = False) -> None:
    """Write ``data`` as strict JSON (no NaN or infinity) with :func:`atomic_write_text`.

    The document is serialised before the file is touched, so data JSON cannot represent
    raises ``ValueError``/``TypeError`` and leaves the old file as it was.
    """
    atomic_write_text(path, json.dumps(data, allow_nan=False) + "\n", parents=parents)
