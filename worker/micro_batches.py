"""Splitting an assigned batch into passes that fit the device (`--micro-batch`).

A machine's memory bounds the batch it can run in one forward/backward pass, not
the share of the global batch it can take: a batch of b samples is run as
passes of at most M samples whose gradients accumulate. Each pass's mean loss is
weighted by its share of the batch (n_i / b), so the accumulated gradient is the
gradient of the whole batch's mean loss. What differs from one pass of b is
what sees a pass at a time: BatchNorm's batch statistics, and any loss that is
not a mean over samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dynabatch.worker.batch_source import batch_len


def micro_batches(batch: Any, micro_batch: int) -> Iterator[tuple[Any, float]]:
    """`(part, share)` pairs covering `batch` in order, each part of at most `micro_batch` samples.

    `micro_batch` 0 (or a batch that fits) gives the batch itself with share 1.0,
    untouched. Parts are views: every tensor whose first dimension is the batch's
    length is sliced along it, as is a list or tuple of plain per-sample values
    (default_collate's strings); anything else (a scalar, a tensor of another
    length) goes to every part unchanged.
    """
    n = batch_len(batch)
    if micro_batch <= 0 or n <= micro_batch:
        yield batch, 1.0
        return
    for start in range(0, n, micro_batch):
        stop = min(n, start + micro_batch)
        yield slice_batch(batch, start, stop, n), (stop - start) / n


def slice_batch(value: Any, start: int, stop: int, n: int) -> Any:
    """Samples `start:stop` of a collated batch of `n` samples (see `micro_batches`)."""
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() > 0 and len(value) == n else value
    if isinstance(value, dict):
        return type(value)((k, slice_batch(v, start, stop, n)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
            parts = [slice_batch(v, start, stop, n) for v in value]
            return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
        return value[start:stop] if len(value) == n else value
    return value
