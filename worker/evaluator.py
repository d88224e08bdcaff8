"""Evaluator mode: pull the current model now and then, report test loss and accuracy.

It trains nothing and pushes nothing. When the job stops it waits until the
workers are gone (the scheduler says so by stopping the evaluator only then),
evaluates the final model once more and reports that result as final.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

from dynabatch.common.chunking import load_flat
from dynabatch.common.data import Dataset, make_batch
from dynabatch.common.messages import EvalReport, Heartbeat
from dynabatch.common.transport import RemoteError
from dynabatch.worker.trainer import Worker

log = logging.getLogger("dynabatch.evaluator")
EVAL_BATCH = 1000


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, between: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(mean test loss, test accuracy) over the whole test set; `between` runs after each batch."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct, n = 0.0, 0, len(data.test_y)
    for start in range(0, n, EVAL_BATCH):
        between()
        idx = torch.arange(start, min(start + EVAL_BATCH, n))
        x, y = make_batch(data, idx, False)
        x, y = x.to(device), y.to(device)
        out = model(x)
        total_loss += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    model.train()
    return total_loss / n, correct / n


class Evaluator(Worker):
    """A worker that only evaluates."""

    def run(self) -> int:
        try:
            if not self.join("evaluator"):
                return 0
            self.health.ready = True
            self._evaluate_until_stopped()
        finally:
            self.link.bye()
        self.after_job()
        return 0

    def _evaluate_until_stopped(self) -> None:
        assignment = None
        while not self.stopping:
            if self.link.lost and not self.register_again("evaluator"):
                return
            final = assignment is not None and assignment.stop
            try:
                report = self._evaluate_once(final)
            except (TimeoutError, RemoteError) as exc:
                log.warning("evaluation skipped: %s", exc)
                report = None
            if report is not None:
                self.link.conn.send(report)
                log.info("model v%d: test loss %.4f, accuracy %.4f%s", report.version, report.test_loss,
                         report.test_acc, " (final)" if final else "")
            if final and report is not None:
                return
            deadline = time.monotonic() + self.job.eval_interval_s
            while not self.stopping and time.monotonic() < deadline:
                self.link.heartbeat(Heartbeat())
                assignment = self.link.wait(min(self.job.heartbeat_s, max(0.0, deadline - time.monotonic())))
                self.health.tick()
                if assignment is not None and assignment.stop:
                    break

    def _evaluate_once(self, final: bool) -> EvalReport:
        pulled = self.shards.pull(None, self.opts.request_timeout_s)
        load_flat(self.model, pulled.flat)
        loss, acc = evaluate(self.model, self.data, self.heartbeat_when_due)
        return EvalReport(version=pulled.version, test_loss=loss, test_acc=acc, final=final)
