"""A task trained in one plain-torch process: the reference the distributed runs are held to.

The tests compute their reference figures with it rather than typing in a number
measured once: the reference then follows the task, torch's version and the data.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dynabatch.optim import SGD, Adam, AdamW, OptimizerSpec
from dynabatch.schedule import Schedule
from dynabatch.task import Task


def _spec(task: Task) -> OptimizerSpec:
    if task.optimizer is None:
        raise ValueError(f"task {task.name} names no optimizer: the plain-torch reference needs one")
    return task.optimizer


def _schedule(task: Task) -> Schedule:
    if task.schedule is None:
        raise ValueError(f"task {task.name} names no schedule: the plain-torch reference needs one")
    return task.schedule


def optimizer_for(task: Task, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's own optimizer for the task's spec, with its `no_decay` parameters in a group without decay."""
    spec = _spec(task)
    decay = [p for n, p in model.named_parameters() if not any(s in n for s in spec.no_decay)]
    rest = [p for n, p in model.named_parameters() if any(s in n for s in spec.no_decay)]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    if isinstance(spec, SGD):
        return torch.optim.SGD(
            groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov, weight_decay=spec.weight_decay
        )
    if not isinstance(spec, Adam):
        raise ValueError(f"optimizer {spec.name}: the plain-torch reference knows SGD, Adam and AdamW")
    kind = torch.optim.AdamW if isinstance(spec, AdamW) else torch.optim.Adam
    return kind(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def train_alone(task: Task, epochs: float, batch: int, seed: int = 0) -> torch.nn.Module:
    """The task's model (built under `seed`) after `epochs` of batches of `batch` from one shuffled order per
    epoch, with the task's optimizer, schedule (by progress) and gradient clipping, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(task, epochs, batch, seed)
    finally:
        torch.set_num_threads(threads)


def _train(task: Task, epochs: float, batch: int, seed: int) -> torch.nn.Module:
    model = task.build_model(seed)
    opt = optimizer_for(task, model)
    data, collate, loss_fn = task.train_data(), task.collate_fn(), task.loss_fn()
    steps = math.ceil(epochs * len(data) / batch)
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    lr, schedule = _spec(task).lr, _schedule(task)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * schedule.factor(step / steps)
        if len(order) < batch:
            order += torch.randperm(len(data), generator=g).tolist()
        idx, order = order[:batch], order[batch:]
        opt.zero_grad()
        torch.autograd.backward(loss_fn(model, collate([data[i] for i in idx])))  # Tensor.backward is untyped
        if task.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip_grad_norm)
        opt.step()
    return model


def evaluate_alone(task: Task, model: torch.nn.Module, batch: int = 256) -> dict[str, float]:
    """Every metric of the task over its whole evaluation set, as sum over count."""
    if task.eval_data is None:
        raise ValueError(f"task {task.name} has no evaluation data to evaluate on")
    data, collate = task.eval_data(), task.collate_fn()
    sums: dict[str, list[float]] = {}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), batch):
            part: Any = collate([data[i] for i in range(start, min(start + batch, len(data)))])
            for metric in task.metric_fns():
                for name, (total, count) in metric(model, part).items():
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0] += total
                    acc[1] += count
    return {name: total / count for name, (total, count) in sums.items() if count}
