"""Atomic file writes: a reader sees the old file or the new one, never a truncated one.

Every file the library saves (records, sweep runs, summaries) goes through
:func:`atomic_write_bytes` (:func:`atomic_write_text`, :func:`write_json`), which behaves
like the editors and tools people trust:

- a symbolic link is followed (the whole chain): the file it points to is replaced, and the
  link stays a link;
- the text is written to a temporary file in the target's folder, flushed and fsynced, given
  the target's permissions (and, where allowed, its owner; the umask's for a new file), moved
  over the target with :func:`os.replace`, and the folder is fsynced so that the rename
  survives a power cut: a reader sees the old file or the new one, whole, never a mix;
- a read-only target (no write permission for this user, or none for anyone) is refused,
  never silently replaced;
- any name the filesystem allows works: the temporary name is shortened (with a hash of the
  name) to fit the folder's name limit (``NAME_MAX``, 255 bytes on most filesystems).

A writer killed mid-write leaves its temporary file behind; the next write of the same target
on the same machine deletes it (another machine's, on a shared filesystem, once it is an hour
old). Errors name the target, never the temporary file.

Examples:
    >>> import json, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_json(folder / "a" / "run.json", {"loss": 0.5}, parents=True)
    >>> json.loads((folder / "a" / "run.json").read_text())
    {'loss': 0.5}
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_text", "write_json"]


_SEPARATORS = tuple(sep for sep in (os.sep, os.altsep) if sep)


def _create_temporary(folder: Path, prefix: str, mode: int) -> tuple[int, str]:
    """Create ``<prefix><pid>.<tag><random>.tmp`` in ``folder``, opened for writing, with
    permissions ``mode & ~umask`` applied by the system (reading the umask would mean setting
    it, which races with other threads creating files).

    Returns:
        The file descriptor and the path.
    """
    # binary on Windows (os.open's default there is text: every \n would become \r\n), and
    # never through a link planted at the name, as tempfile.mkstemp opens its files
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    flags |= getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0)
    while True:
        path = os.path.join(
            folder, f"{prefix}{os.getpid()}.{_machine_tag()}{secrets.token_hex(4)}.tmp"
        )
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue


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


@functools.cache
def _machine_tag() -> str:
    """Six hex digits naming this machine and PID namespace (host name and the namespace's
    inode): a pid in a temporary name means something only where the tag is this one's.

    Examples:
        >>> len(_machine_tag()), _machine_tag() == _machine_tag()
        (6, True)
    """
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS, Windows): the host name alone
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:6]


_STALE_SECONDS = 3600.0
"""Age after which another machine's temporary file is taken as left behind: a write is
seconds from its temporary file's creation to its rename."""


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _name_limit(folder: Path) -> int:
    """The longest file name, in bytes, ``folder``'s filesystem allows (255 if unknown)."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or no answer
        return 255


def _temp_prefix(name: str, limit: int) -> str:
    """``.<name>.``, the start of every temporary name of target ``name``, shortened to fit.

    A temporary name is the prefix, the writer's pid, a dot, the machine's tag
    (:func:`_machine_tag`), 8 random characters and ``.tmp``; when that could exceed
    ``limit`` bytes, ``name`` is cut (on a character boundary) and a hash of the whole name
    keeps prefixes of different targets apart.

    Examples:
        >>> _temp_prefix("r.json", 255)
        '.r.json.'
        >>> p = _temp_prefix("x" * 250, 255)
        >>> len(p.encode()) + 7 + 1 + 14 + 4 <= 255, p[-10]
        (True, '~')
    """
    room = limit - (7 + 1 + 14 + 4)  # pid (up to 7 digits), ".", tag and random, ".tmp"
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) + 2 <= room:
        return f".{name}."
    digest = hashlib.sha256(encoded).hexdigest()[:8]
    head = encoded[: room - 2 - 9].decode("utf-8", "ignore")  # "~" + 8 hex digits
    return f".{head}~{digest}."


def _remove_leftovers(folder: Path, prefix: str) -> None:
    """Delete the temporary files of earlier writes of a target whose writer has died.

    A temporary file is named ``<prefix><pid>.<tag><random>.tmp`` after the process writing
    it and its machine (:func:`_temp_prefix`, :func:`_machine_tag`); a writer killed between
    creating it and the rename (``kill -9``, a power cut) leaves it behind. Files of live
    processes (a concurrent write of the same target) are kept, and so are another machine's
    (a shared filesystem: its pid means nothing here) until they are an hour old.
    """
    tag = _machine_tag()
    for leftover in folder.glob(f"{glob.escape(prefix)}*.tmp"):
        # exactly "<pid>.<tag><random>.tmp" after the prefix:
        # the temporary file of a target whose name extends this one has one more part
        ours = re.fullmatch(r"(\d+)\.([^.]+)\.tmp", leftover.name[len(prefix) :])
        if ours is None:
            continue
        pid, rest = int(ours.group(1)), ours.group(2)
        if len(rest) != 14 or rest[:6] == tag:  # an older version's name has no tag
            dead = pid != os.getpid() and not _pid_alive(pid)
        else:
            try:
                dead = time.time() - leftover.stat().st_mtime > _STALE_SECONDS
            except OSError:  # gone: renamed by its writer
                dead = False
        if dead:
            with contextlib.suppress(OSError):
                leftover.unlink()


def _target_mode(target: Path) -> tuple[int, int, int] | None:
    """``(mode, uid, gid)`` of an existing target, ``None`` for a new one.

    Raises:
        PermissionError: the target is read-only (for this user, or for everyone: even a
            superuser, whom permissions do not stop, does not replace a read-only file).
        IsADirectoryError: the target is a folder.
    """
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory")
    if not os.access(target, os.W_OK) or not st.st_mode & 0o222:
        raise PermissionError(
            13,
            f"the file is read-only (mode {stat.filemode(st.st_mode)}): make it writable "
            "(chmod u+w) or write elsewhere",
        )
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def atomic_write_text(path: str | os.PathLike[str], text: str, *, parents: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write_bytes`.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write_text(folder / "a.txt", "hi")
        >>> (folder / "a.txt").read_text()
        'hi'
    """
    atomic_write_bytes(path, text.encode("utf-8"), parents=parents)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, parents: bool = False) -> None:
    """Write ``data`` to ``path`` atomically and durably.

    A symbolic link is followed to the file it names, which is replaced (the link is kept);
    the new file gets the old one's permissions and, where allowed, its owner. Temporary
    files left in the folder by earlier writers of ``path`` that were killed mid-write are
    deleted first.

    Args:
        path: the target file (or a symbolic link to it).
        data: its new contents.
        parents: create missing parent folders; otherwise a missing folder is an error.

    Raises:
        OSError: the folder is missing or not writable, ``path`` is a folder, or
            (``PermissionError``) a read-only file; the message names ``path``, not the
            temporary file, and no temporary file is left behind.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write_bytes(folder / "nowhere" / "a.txt", b"hi")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: [Errno 2] cannot write '.../nowhere/a.txt': No such file or directory
        >>> (folder / "real.txt").write_text("old")
        3
        >>> (folder / "link.txt").symlink_to("real.txt")
        >>> atomic_write_bytes(folder / "link.txt", b"new")
        >>> (folder / "real.txt").read_text(), (folder / "link.txt").is_symlink()
        ('new', True)
    """
    target = Path(os.path.realpath(path))  # through every symbolic link
    folder = target.parent
    try:
        if os.fspath(path).endswith(_SEPARATORS):  # realpath drops it: "runs/base/" is a folder
            raise IsADirectoryError(21, "the path ends in a separator, so it names a folder")
        if parents:
            folder.mkdir(parents=True, exist_ok=True)
        existing = _target_mode(target)
        prefix = _temp_prefix(target.name, _name_limit(folder))
        _remove_leftovers(folder, prefix)
        # a new file: 0o666 under the umask, as open() gives; an existing one keeps its mode
        fd, tmp = _create_temporary(folder, prefix, 0o666 if existing is None else 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if existing is not None:
                os.chmod(tmp, existing[0])
            owner = (os.geteuid(), os.getegid()) if hasattr(os, "geteuid") else None
            if existing is not None and owner is not None and existing[1:] != owner:
                with contextlib.suppress(OSError):  # only a superuser may give a file away
                    os.chown(tmp, existing[1], existing[2])
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
