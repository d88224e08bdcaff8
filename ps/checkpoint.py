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
        raise ValueError(f"{path}: written for {saved['meta']}, this shard is {meta}")
    return saved["state"]
