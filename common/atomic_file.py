"""Files written whole or not at all, and the one line a failed write becomes.

Every file a process of a job writes while it runs (a shard's checkpoint, the
scheduler's progress, the run folder's summary and timeline, the Prometheus
targets) is written next to its final name, flushed to disk and renamed over it:
a crash or a full disk at any point leaves the old file or the new one, never
half of one, and no temporary file either. A full disk is no crash and a restart
cannot fix it: `storage_error` turns it into the line a command exits 2 with.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

# A write that fails for one of these fails again after a restart: the disk, not the process.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}


def previous_path(path: Path) -> Path:
    """Where `write_atomic(..., keep_previous=True)` keeps the copy it replaced."""
    return path.with_name(f"{path.name}.prev")


def write_atomic(path: Path, write: Callable[[IO[bytes]], object], keep_previous: bool = False) -> None:
    """Call `write` on a temporary file beside `path`, fsync it and rename it to `path` (the copy it replaces
    renamed to `previous_path(path)` first, with `keep_previous`).

    On any error the temporary file is removed and the error raised; an OSError names `path`
    (the file the caller asked for), not the temporary one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, os.strerror(exc.errno), str(path)) from exc
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """`write_atomic` of a text file (UTF-8)."""
    write_atomic(path, lambda f: f.write(text.encode()))


def out_of_descriptors(exc: OSError) -> bool:
    """The write failed for want of a file descriptor: for a server, a moment of a connection flood (ZeroMQ
    accepts connections before its caps close the refused ones), not a broken disk; the next save may pass."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


def no_space_left(path: Path) -> bool:
    """The file system holding `path` has no block left for an unprivileged writer."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def storage_error(exc: BaseException) -> str | None:
    """`no space left on device writing PATH` for a write the storage refused, else None."""
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_ERRNOS:
        return None
    return STORAGE_ERRNOS[exc.errno] + (f" writing {exc.filename}" if exc.filename else "")
