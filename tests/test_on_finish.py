"""`--on-finish`: shards and workers exit when the job ends (local runs) or idle serving /healthz (Kubernetes)."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import pytest

from hang_guard import hang_guard_s
from harness import Cluster, Proc, wait_for

pytestmark = pytest.mark.slow


def _healthz(p: Proc) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/healthz", timeout=5) as r:
        code: int = r.status
    return code


def test_idle_processes_outlive_the_job_and_stop_on_sigterm(tmp_path: Path) -> None:
    c = Cluster(
        tmp_path,
        ["--dataset", "synthetic", "--model", "mlp", "--epochs", "2", "--eval-interval-s", "1", "--min-workers", "2"],
    )
    try:
        c.scheduler()
        idle = [
            c.shard(0, None, "--on-finish", "idle"),
            c.worker("a", "--on-finish", "idle"),
            c.worker("ev", "--evaluator", "--on-finish", "idle"),
        ]
        exits = c.worker("b")  # the default: exit with the job
        c.wait_status("the job to finish", lambda s: s.finished, timeout_s=120)
        assert exits.proc.wait(hang_guard_s(30)) == 0
        for p in idle:

            def idling(p: Proc = p) -> bool:
                return "idling until stopped" in p.log_text()

            wait_for(f"{p.name} to idle", idling, timeout_s=30)
        for p in idle:
            assert p.alive(), p.log_text()
            assert _healthz(p) == 200, p.name
        for p in idle:
            p.proc.send_signal(signal.SIGTERM)
        for p in idle:
            assert p.proc.wait(hang_guard_s(15)) == 0, p.log_text()
    finally:
        c.stop()
