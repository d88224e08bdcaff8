"""Checkpoints a shard can trust when it reads them back (common/verified_files.py).

The file is checksummed, written atomically, and the one it replaces is kept
as `.prev`. On resume a copy that fails its checksum, does not load, or holds a
non-finite value anywhere (parameters, optimizer state, buffers) is refused with
one line and the previous copy is tried; with no good copy the shard starts
without one, and the first worker's INIT gives it a model again (the scheduler
counts the lost versions back into the job), rather than not starting at all.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch

from dynabatch.common.verified_files import DamagedFile, load_newest_good, write_verified

FORMAT = 2  # 2: per-chunk optimizer state ("optimizer_state") instead of momentum buffers
log = logging.getLogger("dynabatch.ps")


def save_checkpoint(path: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Write {format, meta, state} to `path` atomically, under its checksum, keeping the previous copy."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "meta": meta, "state": state}, buf)
    write_verified(path, buf.getvalue())


def load_checkpoint(path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The state of the newest good copy of `path` written for the same `meta`; None if there is none.

    A checkpoint of another job or layout raises ValueError rather than being
    silently ignored or, worse, loaded into the wrong model.
    """
    try:
        return load_newest_good(path, lambda copy, payload: _parse(copy, payload, meta), log.error)
    except DamagedFile:
        log.error(
            "no good checkpoint at %s: starting without one; the first worker's model (INIT) takes its place", path
        )
        return None


def _parse(path: Path, payload: bytes, meta: dict[str, Any]) -> dict[str, Any]:
    try:
        saved = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # a payload that passed its checksum but does not load was written wrong
        raise DamagedFile(f"{path}: does not load ({type(exc).__name__}: {exc})") from None
    if not isinstance(saved, dict) or "meta" not in saved or not isinstance(saved.get("state"), dict):
        raise DamagedFile(f"{path}: not a shard checkpoint")
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {saved.get('format')!r}, expected {FORMAT}")
    if saved["meta"] != meta:
        raise ForeignCheckpoint(path, saved["meta"], meta)
    bad = _non_finite(saved["state"])
    if bad:
        raise DamagedFile(f"{path}: {bad} non-finite values (a model that had diverged, or a damaged file)")
    state: dict[str, Any] = saved["state"]
    return state


def _non_finite(value: Any) -> int:
    """How many non-finite floating values `value` (tensors in nested dicts and lists) holds."""
    if isinstance(value, torch.Tensor):
        return int((~torch.isfinite(value)).sum()) if value.is_floating_point() else 0
    if isinstance(value, dict):
        return sum(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_non_finite(v) for v in value)
    return 0


class ForeignCheckpoint(ValueError):
    """The checkpoint at `path` belongs to another job (or shard, shard count, chunk size).

    Its message is the one line the shard logs before it exits 2: what is there, what this
    shard is, and the operator's two ways out.
    """

    def __init__(self, path: Path, saved: dict[str, Any], meta: dict[str, Any]) -> None:
        differ = ", ".join(
            f"{k} {saved.get(k)!r} there, {meta.get(k)!r} here" for k in meta if saved.get(k) != meta.get(k)
        )
        super().__init__(
            f"{path} is a checkpoint of another job ({differ}): refusing to load or overwrite it; "
            f"for a job from scratch delete it (on Kubernetes, the shard's claim), else start this "
            f"shard in the job it belongs to"
        )
