"""SIGTERM stops a worker or an evaluator that waits on a shard that will not answer, within a heartbeat.

`dynabatch run` stops its children with SIGTERM and waits 15 s before SIGKILL, and
Kubernetes gives a pod its grace period: a process that kept waiting for a gone
shard until its request timed out (30 s) outlived both. A run whose shard died of
a full disk spent 30 s stopping its worker and evaluator that way.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from dynabatch.worker.options import WorkerOptions
from harness import Cluster

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = WorkerOptions().request_timeout_s  # what a wait on the stopped shard would last


def test_a_worker_and_an_evaluator_waiting_on_a_stopped_shard_stop_on_sigterm(tmp_path: Path) -> None:
    c = Cluster(
        tmp_path,
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--eval-interval-s",
            "0.5",
            "--heartbeat-s",
            "0.2",
        ],
    )
    shard = None
    try:
        c.scheduler()
        shard = c.shard()
        waiting = [c.worker("w"), c.worker("ev", "--evaluator")]
        c.wait_status(
            "training and an evaluation",
            lambda s: s.workers and all(w.steps > 3 for w in s.workers.values()) and s.test_acc is not None,
        )
        # The worker's push or pull waits on the stopped shard, unless the signal finds it between two steps.
        shard.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        for p in waiting:
            p.proc.send_signal(signal.SIGTERM)
        for p in waiting:
            assert p.proc.wait(REQUEST_TIMEOUT_S) == 0, p.log_text()
            took = time.monotonic() - stopped_at
            assert took < REQUEST_TIMEOUT_S / 2, f"{p.name} took {took:.1f} s to stop: it waited out its request"
    finally:
        if shard is not None:
            shard.proc.send_signal(signal.SIGCONT)
        c.stop()
