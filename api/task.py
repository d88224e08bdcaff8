"""What is trained: one `Task` (model factory, data, collate, loss, metrics, optimizer, schedule).

Only workers and evaluators run a task's code. Shards are a generic parameter
store that the first worker initialises with the model's signature and initial
parameters (common/wire/model_signature.py); the scheduler learns the training set's
length from the workers. The built-in models and datasets are tasks like any other
(common/tasks/builtin_tasks.py). How a task is loaded by `--task` and checked before any
process starts is common/tasks/task_check.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from dynabatch.metrics import Metric, accuracy
from dynabatch.optim import OptimizerSpec
from dynabatch.schedule import Schedule

__all__ = ["Task"]


@dataclass
class Task:
    """Everything dynabatch needs to train a model: the pinned user-facing API (`dynabatch.Task`).

    - `model`: () -> nn.Module, built under the job's seed in every process; two builds must be identical.
    - `train_data`, `eval_data`: () -> a map-style torch Dataset (`__len__`, `__getitem__`).
    - `collate`: list of samples -> batch (default: torch's `default_collate`); batches may be tuples or dicts.
    - `loss`: (model, batch) -> mean loss tensor (default: cross-entropy on an (x, y) batch).
    - `metrics`: (model, batch) -> {name: (sum, count)}, or a list of such (default: accuracy);
      the evaluation loss is always reported too.
    - `optimizer`: the shards' optimizer (dynabatch.optim); None: SGD from the job's flags.
    - `schedule`: the learning rate against global progress (dynabatch.schedule); None: constant.
    - `clip_grad_norm`: clip each worker's gradient to this norm before it is pushed.
    """

    model: Callable[[], nn.Module]
    train_data: Callable[[], Any]
    eval_data: Callable[[], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    metrics: Metric | Sequence[Metric] | None = None
    optimizer: OptimizerSpec | None = None
    schedule: Schedule | None = None
    clip_grad_norm: float | None = None
    name: str = field(default="task", compare=False)

    def __post_init__(self) -> None:
        """Refuse, where the task is written, a field of the wrong kind (a model instance for its factory, a name
        for an optimizer or schedule) or a clip that cannot train: each failed only in the workers, or trained the
        wrong way without a word (a negative clip turned every gradient round)."""
        if isinstance(self.model, nn.Module) or not callable(self.model):
            raise TypeError(f"Task: model must be a function that builds the model, got {type(self.model).__name__}")
        for name in ("train_data", "eval_data", "collate", "loss"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Task: {name} must be a function, got {type(value).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(
                f"Task: optimizer must be a dynabatch.optim spec (db.optim.SGD(lr=...)), got {self.optimizer!r}"
            )
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise TypeError(
                f"Task: schedule must be a dynabatch.schedule (db.schedule.warmup_cosine()), got {self.schedule!r}"
            )
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0
        ):
            raise ValueError(f"Task: clip_grad_norm must be a positive finite number or None, got {clip!r}")

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self.collate or default_collate

    def loss_fn(self) -> Callable[[nn.Module, Any], torch.Tensor]:
        return self.loss or cross_entropy

    def metric_fns(self) -> list[Metric]:
        if self.metrics is None:
            return [accuracy]
        return list(self.metrics) if isinstance(self.metrics, Sequence) else [self.metrics]

    def build_model(self, seed: int) -> nn.Module:
        """The model at its initial parameters under `seed`, leaving the caller's RNG as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.model()


def cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: cross-entropy of model(x) against labels y."""
    x, y = batch[0], batch[1]
    return nn.functional.cross_entropy(model(x), y)
