"""Atomic file writes: a reader sees the old file or the new one, never a truncated one.

Every file the library saves (records, sweep runs, summaries) goes through
:func:`atomic_write_text`: the text is written to a temporary file in the target's folder,
flushed and fsynced, given the target's permissions (an existing file's, else the umask's),
moved over the target with :func:`os.replace`, and the folder is fsynced so that the rename
survives a power cut. A writer killed mid-write leaves its temporary file behind; the next
write of the same target deletes it. Errors name the target, never the temporary file.

Examples:
    >>> import json, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_json(folder / "a" / "run.json", {"loss": 0.5}, parents=True)
    >>> json.loads((folder / "a" / "run.json").read_text())
    {'loss': 0.5}
"""

from __future__ import annotations

import contextlib
import glob
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


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _remove_leftovers(target: Path) -> None:
    """Delete the temporary files of earlier writes of ``target`` whose writer has died.

    A temporary file is named ``.<name>.<pid>.<random>.tmp`` after the process writing it; a
    writer killed between creating it and the rename (``kill -9``, a power cut) leaves it
    behind. Files of live processes (a concurrent write of the same target) are kept.
    """
    prefix = f".{target.name}."
    for leftover in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = leftover.name[len(prefix) :].partition(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                leftover.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str, *, parents: bool = False) -> None:
    """Write ``text`` to ``path`` atomically and durably.

    Temporary files left in the folder by earlier writers of ``path`` that were killed
    mid-write are deleted first.

    Args:
        path: the target file.
        text: its new contents (UTF-8).
        parents: create missing parent folders; otherwise a missing folder is an error.

    Raises:
        OSError: the folder is missing or not writable, or ``path`` is a folder; the message
            names ``path``, not the temporary file, and no temporary file is left behind.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write_text(folder / "nowhere" / "a.txt", "hi")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: [Errno 2] cannot write '.../nowhere/a.txt': No such file or directory
    """
    target = Path(path)
    folder = target.parent.absolute()
    try:
        if parents:
            folder.mkdir(parents=True, exist_ok=True)
        try:
            mode = os.stat(target).st_mode & 0o777
        except FileNotFoundError:
            mode = _new_file_mode()
        _remove_leftovers(folder / target.name)
        fd, tmp = tempfile.mkstemp(
            dir=folder, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp"
        )
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
    except OSError as err:
        reason = err.strerror or str(err)
        raise type(err)(err.errno, f"cannot write {os.fspath(path)!r}: {reason}") from err
    _fsync_dir(folder)


def write_json(path: str | os.PathLike[str], data: Any, *, parents: bool = False) -> None:
    """Write ``data`` as strict JSON (no NaN or infinity) with :func:`atomic_write_text`.

    The document is serialised before the file is touched, so data JSON cannot represent
    raises ``ValueError``/``TypeError`` and leaves the old file as it was.
    """
    atomic_write_text(path, json.dumps(data, allow_nan=False) + "\n", parents=parents)
