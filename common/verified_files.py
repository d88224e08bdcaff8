"""Files a process reads back after a restart: checksummed, written atomically, the last two kept.

A shard's checkpoint and the scheduler's progress file are believed when they are
read back, so a flipped bit, a truncated write (a full disk) or an edit must be
told apart from the state that was saved. Each file starts with one header line,
`dynabatch-verified sha256 <hex>`, the SHA-256 of the rest (the payload). It is
written next to its name, flushed to disk and renamed over it, after the copy it
replaces was renamed to `<name>.prev`: a crash at any point leaves a good file
under one of the two names.

Reading tries the newest copy, then the previous one: a copy that fails its
checksum, or that its reader finds damaged (`DamagedFile`: non-finite values, a
figure that cannot be), is passed over with one line saying why. A file written
for another job is not damage: the reader raises that as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dynabatch.common.atomic_file import previous_path, write_atomic

HEADER = b"dynabatch-verified sha256 "
T = TypeVar("T")


class DamagedFile(ValueError):
    """A saved file that is not what was written: another copy may be."""


def write_verified(path: Path, payload: bytes) -> None:
    """Write `payload` under a checksum header to `path` atomically, keeping the copy it replaces as `.prev`."""
    header = HEADER + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    write_atomic(path, lambda f: f.write(header + payload), keep_previous=True)


def read_verified(path: Path) -> bytes:
    """The payload of `path`; DamagedFile if it has no header or its checksum does not match."""
    data = path.read_bytes()
    head, _, payload = data.partition(b"\n")
    if not head.startswith(HEADER):
        raise DamagedFile(f"{path}: no checksum header (truncated, or not written by dynabatch)")
    if hashlib.sha256(payload).hexdigest().encode() != head[len(HEADER) :]:
        raise DamagedFile(
            f"{path}: its content does not match its checksum ({len(payload)} bytes; truncated or altered)"
        )
    return payload


def load_newest_good(path: Path, parse: Callable[[Path, bytes], T], warn: Callable[[str], None]) -> T | None:
    """`parse(copy, payload)` of the newest copy of `path` that reads back good; None if there is no copy.

    A damaged copy is reported through `warn` (one line) and the previous one is
    tried; DamagedFile naming every copy if none is good.
    """
    copies = [p for p in (path, previous_path(path)) if p.exists()]
    if not copies:
        return None
    problems = []
    for copy in copies:
        try:
            return parse(copy, read_verified(copy))
        except DamagedFile as exc:
            problems.append(str(exc))
            warn(f"refused {exc}" + ("; trying the previous copy" if copy == path and len(copies) > 1 else ""))
        except OSError as exc:
            problems.append(f"{copy}: {exc}")
            warn(f"refused {copy}: {exc}")
    raise DamagedFile("; ".join(problems))
