"""Output files that are never lost: checked before the work, written atomically.

Every command that writes a file checks its path first (`check_output`, so that a long search
or profile does not fail at its end) and writes through `atomic_open` / `atomic_write`: the data
goes to a temporary file beside the target, which is flushed, synced and renamed over the target.
A kill, a full disk or any error while writing leaves the previous file as it was (and no
temporary file behind); errors are one-line `OutputError`s naming the flag.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

from .ir import KoalaError


class OutputError(KoalaError):
    """An output file cannot be written (bad path, no permission, disk full)."""


def _label(path: Path, flag: str | None) -> str:
    return f"{flag} {path}" if flag else str(path)


def check_output(path: str | os.PathLike, flag: str | None = None, suffixes: tuple[str, ...] = ()) -> Path:
    """`path` as a Path, or an `OutputError` saying why it cannot be written: its folder does
    not exist or is not writable, it is a folder, or (with `suffixes`) its suffix is not one of
    them. Nothing is created."""
    path = Path(path)
    label = _label(path, flag)
    if suffixes and path.suffix.lower() not in suffixes:
        raise OutputError(f"{label}: use a file name ending in {' or '.join(suffixes)}")
    if path.is_dir() or str(path).endswith(os.sep):
        raise OutputError(f"{label}: is a directory; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{label}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{label}: directory {folder} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{label}: the file exists and is not writable")
    return path


def _file_mode(path: Path) -> int:
    """The mode the target keeps (its own when it exists, else the default for new files)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", flag: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing (`mode` "w" or "wb"); on a clean exit it
    replaces `path`, on an error it is removed and `path` is left as it was. A symbolic link's
    target is the file replaced (the link stays); a device or a pipe is written in place."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    label = _label(Path(path), flag)
    path = Path(os.path.realpath(path))  # a symbolic link keeps pointing at the file it names, rewritten
    if path.exists() and not path.is_file():  # a device or a pipe (-o /dev/stdout): a stream, not replaced
        with _stream(path, mode, label) as fh:
            yield fh
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        raise OutputError(f"cannot write {label}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {label}: {exc.strerror or exc}") from None
        raise


@contextlib.contextmanager
def _stream(path: Path, mode: str, label: str) -> Iterator[IO]:
    """`path` opened for writing in place: what `atomic_open` does for what is not a regular file."""
    try:
        with open(path, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
    except OSError as exc:
        raise OutputError(f"cannot write {label}: {exc.strerror or exc}") from None


def atomic_write(path: str | os.PathLike, data: str | bytes, flag: str | None = None) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path` atomically (see `atomic_open`)."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", flag) as fh:
        fh.write(data)
    return Path(path)
