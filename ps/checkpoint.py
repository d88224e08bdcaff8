"""Atomic checkpoints: a shard never leaves a half-written file behind.

The file is written next to its final name, flushed to disk, then renamed over
it (common/atomic_file.py); a crash at any point leaves either the old checkpoint or the new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dynabatch.common.atomic_file import write_atomic

FORMAT = 2  # 2: per-chunk optimizer state ("optimizer_state") instead of momentum buffers


def save_checkpoint(path: Path, meta: dict[str, Any], state: dict[str, Any]) -> None:
    """Write {format, meta, state} to `path` atomically."""
    write_atomic(path, lambda f: torch.save({"format": FORMAT, "meta": meta, "state": state}, f))


def load_checkpoint(path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The saved state if `path` exists and was written for the same `meta`, else None.

    A checkpoint of another job or layout raises ValueError rather than being
    silently ignored or, worse, loaded into the wrong model.
    """
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {saved.get('format')!r}, expected {FORMAT}")
    if saved["meta"] != meta:
        raise ForeignCheckpoint(path, saved["meta"], meta)
    return saved["state"]


class ForeignCheckpoint(ValueError):
    """The checkpoint at `path` belongs to another job (or shard, shard count, chunk size).

    Its message is the one line the shard logs before it exits 2: what is there, what this
    shard is, and the operator's two ways out.
    """

    def __init__(self, path: Path, saved: dict[str, Any], meta: dict[str, Any]) -> None:
        differ = ", ".join(f"{k} {saved.get(k)!r} there, {meta.get(k)!r} here"
                           for k in meta if saved.get(k) != meta.get(k))
        super().__init__(f"{path} is a checkpoint of another job ({differ}): refusing to load or overwrite it; "
                         f"for a job from scratch delete it (on Kubernetes, the shard's claim), else start this "
                         f"shard in the job it belongs to")
