"""A task whose loss blows up once, for a few steps, then never again: a transient cause of divergence.

The blobs task (blobs.py) without gradient clipping or schedule, whose training loss is
multiplied by `SPIKE` for the `SPIKE_STEPS` training passes after the first
`SPIKE_AT` of each process. The gradient of those steps is as much larger, and
the model they reach is wrecked; once the job has rolled back past them, the
process's count has moved on and training is healthy again. Deterministic:
the count is of this process's own training passes (its start-up probe included),
not of time.
"""

import itertools
from dataclasses import replace

import blobs
import torch
from torch import nn

SPIKE, SPIKE_AT, SPIKE_STEPS = 1e6, 40, 3
_passes = itertools.count()


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    value = nn.functional.cross_entropy(model(batch["features"]), batch["label"])
    if model.training and SPIKE_AT <= next(_passes) < SPIKE_AT + SPIKE_STEPS:
        return value * SPIKE
    return value


task = replace(blobs.task, loss=loss, metrics=[blobs.accuracy], schedule=None, clip_grad_norm=None)
