"""Evaluation metrics: each a function (model, batch) -> {name: (sum, count)}.

Sums and counts rather than means, so that batches of any size (and the last,
short one) add up to the exact mean over the evaluation set. `dynabatch.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Metric", "accuracy"]

Metric = Callable[[torch.nn.Module, Any], dict[str, tuple[float, float]]]


def accuracy(model: torch.nn.Module, batch: Any) -> dict[str, tuple[float, float]]:
    """Top-1 accuracy on an (inputs, labels) batch."""
    x, y = batch[0], batch[1]
    correct = (model(x).argmax(dim=-1) == y).sum()
    return {"accuracy": (float(correct), float(y.numel()))}
