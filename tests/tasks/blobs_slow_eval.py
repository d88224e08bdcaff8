"""The blobs task on a slow evaluator: each evaluation batch idles IDLE_PER_BATCH_S after its forward pass,
as an emulated slowdown (common/slowdown.py) idles a slow worker, so every evaluation is reported well after
the model it evaluated existed."""

import time
from dataclasses import replace

import torch
from blobs import accuracy, task
from torch import nn

IDLE_PER_BATCH_S = 1.0  # the evaluation set's 1000 samples are 4 evaluation batches: 4 s an evaluation
EVAL_IDLE_S = 4 * IDLE_PER_BATCH_S


def slow_accuracy(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    result = accuracy(model, batch)
    time.sleep(IDLE_PER_BATCH_S)
    return result


task = replace(task, metrics=[slow_accuracy])
