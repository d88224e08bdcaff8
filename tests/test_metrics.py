"""Every process's /metrics passes `promtool check metrics`; /healthz and /readyz answer."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest

from harness import Cluster, metric_value
from tools import need_tool

pytestmark = pytest.mark.slow


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_every_process_serves_lint_clean_metrics_and_health(tmp_path):
    promtool = need_tool("promtool", "apt-get install -y prometheus (ships promtool)")
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "1"])
    try:
        c.scheduler()
        c.shard()
        c.worker("a")
        c.worker("ev", "--evaluator")
        c.wait_status("training and one evaluation",
                      lambda s: s.workers and all(w.steps > 3 for w in s.workers.values())
                      and s.test_acc is not None)
        for p in c.procs:
            text = p.metrics()
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
            assert lint.returncode == 0, f"{p.name}: {lint.stdout}{lint.stderr}"
            assert _status(p.metrics_port, "/healthz") == 200, p.name
            assert _status(p.metrics_port, "/readyz") == 200, p.name
            assert _status(p.metrics_port, "/nope") == 404
        scheduler, shard, worker = c.procs[0].metrics(), c.procs[1].metrics(), c.procs[2].metrics()
        assert metric_value(scheduler, "dynabatch_scheduler_live_workers") == 1
        assert metric_value(scheduler, "dynabatch_job_test_accuracy") > 0
        assert metric_value(shard, "dynabatch_ps_updates_total", shard="0") > 0
        assert metric_value(worker, "dynabatch_worker_steps_total") > 3
        assert metric_value(worker, "dynabatch_worker_phase_seconds_count", phase="data") > 3, "waiting for data"
        assert metric_value(scheduler, "dynabatch_worker_step_seconds", phase="data") > 0
    finally:
        c.stop()
