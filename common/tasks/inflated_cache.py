"""Gzip'd dataset files inflated once per host, then mapped by every process that reads them.

Every worker and evaluator of a job reads its dataset at start, and `dynabatch run`
checks it first: inflating Fashion-MNIST's gzip would cost each of them a share of a
small job's CPU, and each would keep its own inflated copy (bench/RESULTS.md 16).
The first reader on a host writes the inflated bytes to the cache
(dataset_files.CACHE_DIR/inflated); later readers map that file (copy-on-write pages that
the kernel shares between the processes until one writes to them).

A cached file is believed only when its length and CRC-32 are the ones its source
declares in its gzip trailer (a check far cheaper than inflating); one that is not is
inflated again from the source and replaced. A cache that cannot be written (a
read-only home, a full disk) costs the inflating, nothing more. Kept free of torch,
as dataset_files is.
"""

from __future__ import annotations

import gzip
import mmap
import os
import sys
import zlib
from pathlib import Path

from dynabatch.common.atomic_file import write_atomic


def inflated(path: Path, cache: Path) -> bytes | mmap.mmap:
    """The decompressed content of the gzip file `path`, kept in the folder `cache` (OSError or EOFError if
    it does not decompress)."""
    crc, size = _declared(path)
    cached = cache / f"{path.name.removesuffix('.gz')}-{crc:08x}-{size}"
    if (mapped := _mapped(cached, crc, size)) is not None:
        return mapped
    raw = gzip.decompress(path.read_bytes())
    if len(raw) == size and zlib.crc32(raw) == crc:  # a single-member file: its trailer describes it all
        _store(cached, raw)
    return raw


def _declared(path: Path) -> tuple[int, int]:
    """The CRC-32 and length (mod 2**32) that the gzip trailer of `path` declares for its content."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:  # a gzip header and trailer at least; gzip.decompress says what is wrong
            return 0, 0
        f.seek(-8, os.SEEK_END)
        trailer = f.read(8)
    return int.from_bytes(trailer[:4], "little"), int.from_bytes(trailer[4:], "little")


def _mapped(cached: Path, crc: int, size: int) -> mmap.mmap | None:
    """`cached` mapped copy-on-write if it holds `size` bytes of checksum `crc`; None if not (or not there)."""
    try:
        with open(cached, "rb") as f:
            if size == 0 or os.fstat(f.fileno()).st_size != size:
                return None
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError:
        return None
    if zlib.crc32(mapped) != crc:
        mapped.close()
        return None
    return mapped


def _store(cached: Path, raw: bytes) -> None:
    """Write `raw` to `cached` whole or not at all (`write_atomic`: two processes on one host may both be
    writing it); a cache that cannot be written is said once on stderr and left alone."""
    try:
        write_atomic(cached, lambda f: f.write(raw))
    except OSError as exc:
        print(
            f"dynabatch: not caching the inflated {cached.name} ({exc.strerror or exc}); each start inflates it again",
            file=sys.stderr,
        )
