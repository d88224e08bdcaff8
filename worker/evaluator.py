"""Evaluator mode: pull the current model now and then, report the task's loss and metrics.

It trains nothing and pushes nothing. It evaluates the pulled parameters with
the pulled travelling buffers (BatchNorm's running statistics, as shard 0
averages them), so a BatchNorm model is judged by the job's estimate rather
than by its factory-fresh statistics. When the job stops it waits until the
workers are gone (the scheduler says so by stopping the evaluator only then),
evaluates the final model once more and reports that result as final.

It shares with the trainer (trainer.py) only what both use: the process around
it (role_process.py: registration, heartbeats, metrics server) and what joining
brings (joined.py: the job, the task, the model and the shards' clients).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from dynabatch.common.net.transport import RemoteError
from dynabatch.common.tasks.task_check import build_data
from dynabatch.common.wire.chunking import load_flat
from dynabatch.common.wire.messages import EvalReport, WorkerHeartbeat
from dynabatch.task import Task
from dynabatch.task_error import TaskError
from dynabatch.worker.batch_source import batch_len, fetch, to_device
from dynabatch.worker.joined import Joined
from dynabatch.worker.options import WorkerOptions
from dynabatch.worker.role_process import RoleProcess

log = logging.getLogger("dynabatch.evaluator")
# Batches whose activations stay in the CPU's caches: the CNN evaluates Fashion-MNIST's 10,000 test images in
# 2.8 to 3.8 s at 256 against 4.5 to 5.0 s at 1,000 (one thread, measured side by side).
EVAL_BATCH = 256


class OneForwardPerBatch(torch.nn.Module):
    """The model as the evaluation's loss and metrics see it: they all call it on the same batch,
    and one forward pass serves them all (the same input objects give the cached output)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._key: tuple[Any, ...] | None = None
        self._out: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key = tuple(id(a) for a in args) + tuple((k, id(v)) for k, v in sorted(kwargs.items()))
        if key != self._key:
            self._key, self._out = key, self.model(*args, **kwargs)
        return self._out

    def forget(self) -> None:
        self._key = self._out = None


@torch.no_grad()
def evaluate(
    task: Task, model: torch.nn.Module, data: Any, device: torch.device, between: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """The task's loss and metrics over the whole evaluation set, by name; `between` runs after each batch.

    The loss is the sample-weighted mean of the task's (batch-mean) loss; each metric
    is its summed numerator over its summed count (left out where it counted nothing).
    """
    model.eval()
    once = OneForwardPerBatch(model)
    loss_fn, collate, metric_fns = task.loss_fn(), task.collate_fn(), task.metric_fns()
    total_loss, n = 0.0, 0
    sums: dict[str, list[float]] = {}
    try:
        for start in range(0, len(data), EVAL_BATCH):
            between()
            batch = to_device(fetch(data, torch.arange(start, min(start + EVAL_BATCH, len(data))), collate), device)
            size = batch_len(batch)
            total_loss += float(loss_fn(once, batch)) * size
            n += size
            for metric in metric_fns:
                for name, (value, count) in metric(once, batch).items():
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0] += float(value)
                    acc[1] += float(count)
            once.forget()
    finally:
        model.train()
    return {"loss": total_loss / n, **{name: v / c for name, (v, c) in sums.items() if c}}


class Evaluator:
    """An evaluator: now and then pulls the job's current model and reports its loss and metrics on the task's
    evaluation set, and once more, as final, when the job ends. It trains and pushes nothing."""

    def __init__(self, opts: WorkerOptions, process: RoleProcess, joined: Joined) -> None:
        if joined.task.eval_data is None:
            raise TaskError("the task has no eval_data for the evaluator to evaluate on")
        self.opts = opts
        self.process = process
        self.joined = joined
        self.data = build_data(joined.task.eval_data, "eval_data")  # the task's evaluation set

    def run(self) -> None:
        """Evaluate now and then until the job ends, then once more as final."""
        self.process.health.ready = True
        self._evaluate_until_stopped()

    def _evaluate_until_stopped(self) -> None:
        process, link, job = self.process, self.process.link, self.joined.job
        assignment = None
        while not process.stopping:
            if link.lost and not process.register_again(self.joined):
                return
            final = assignment is not None and assignment.stop
            try:
                report = self._evaluate_once(final)
            except (TimeoutError, RemoteError) as exc:
                log.warning("evaluation skipped: %s", exc)
                report = None
            evaluated = report is not None
            if report is not None and not math.isfinite(report.test_loss):  # the scheduler refuses it (eval_bounds)
                log.warning(
                    "model v%d: its loss is %s (diverged?); not reported%s",
                    report.version,
                    report.test_loss,
                    ", and no final evaluation" if final else "",
                )
                report = None
            if report is not None:
                link.send(report)
                log.info(
                    "model v%d: %s%s",
                    report.version,
                    ", ".join(f"{name} {value:.4f}" for name, value in report.metrics.items()),
                    " (final)" if final else "",
                )
            if final and evaluated:
                return
            # A skipped evaluation is tried again after a heartbeat, not a whole interval: a shard that restarted
            # answers the new pull as soon as it is back, and the job's curve has no hole of --eval-interval-s.
            deadline = time.monotonic() + (job.eval_interval_s if evaluated else job.heartbeat_s)
            while not process.stopping and time.monotonic() < deadline:
                assignment = link.ask(WorkerHeartbeat())
                process.health.tick()
                if link.lost or (assignment is not None and assignment.stop):
                    break  # forgotten: register again now, not an interval later (the pulse would take it for hung)

    def _evaluate_once(self, final: bool) -> EvalReport:
        joined = self.joined
        pulled = joined.shards.pull(None, self.opts.request_timeout_s)
        load_flat(joined.model, pulled.flat)
        joined.buffers.load(joined.model, pulled.buffers)  # the job's running statistics, not the factory's
        metrics = evaluate(joined.task, joined.model, self.data, self.process.device, self.process.beat.when_due)
        finite = {name: value for name, value in metrics.items() if math.isfinite(value)}  # refused otherwise
        return EvalReport(
            version=pulled.version,
            test_loss=metrics["loss"],
            test_acc=finite.get("accuracy", math.nan),
            final=final,
            metrics=finite,
        )
