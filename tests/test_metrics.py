"""Every process's /metrics passes `promtool check metrics`; /healthz and /readyz answer; the scheduler
exports the latest evaluation's metrics by name."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from harness import Cluster, metric_value, wait_for
from tools import need_tool

pytestmark = pytest.mark.slow


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            code: int = r.status
            return code
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A training job with an evaluator: scheduler, shard, worker, evaluator (in that order in `procs`), under
    `--protocol auto`, whose protocol in force the scheduler exports."""
    c = Cluster(
        tmp_path_factory.mktemp("metrics"),
        [
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--eval-interval-s",
            "1",
            "--protocol",
            "auto",
        ],
    )
    try:
        c.scheduler()
        c.shard()
        c.worker("a")
        c.worker("ev", "--evaluator")
        c.wait_status(
            "training and one evaluation",
            lambda s: s.workers and all(w.steps > 3 for w in s.workers.values()) and s.test_acc is not None,
        )
        yield c
    finally:
        c.stop()


def test_every_process_serves_lint_clean_metrics_and_health(live: Cluster) -> None:
    promtool = need_tool("promtool", "apt-get install -y prometheus (ships promtool)")
    for p in live.procs:
        text = p.metrics()
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, f"{p.name}: {lint.stdout}{lint.stderr}"
        assert _status(p.metrics_port, "/healthz") == 200, p.name
        assert _status(p.metrics_port, "/readyz") == 200, p.name
        assert _status(p.metrics_port, "/nope") == 404
    shard, worker = (p.metrics() for p in live.procs[1:3])
    assert metric_value(shard, "dynabatch_ps_updates_total", shard="0") > 0
    assert metric_value(worker, "dynabatch_worker_steps_total") > 3
    assert metric_value(worker, "dynabatch_worker_phase_seconds_count", phase="data") > 3, "waiting for data"

    def scheduler_series() -> bool:  # copied from its state every EXPORT_EVERY_S: STATUS may be newer
        scheduler, status = live.procs[0].metrics(), live.status()
        return (
            status is not None
            and metric_value(scheduler, "dynabatch_scheduler_live_workers") == 1
            and metric_value(scheduler, "dynabatch_job_test_accuracy") > 0
            and metric_value(scheduler, "dynabatch_worker_step_seconds", phase="data") > 0
            and metric_value(scheduler, "dynabatch_scheduler_auto_protocol", protocol=status.protocol) == 1
        )

    wait_for(
        "the scheduler's series: one live worker, its step times, an evaluation, the protocol in force",
        scheduler_series,
        30,
    )


def test_the_scheduler_exports_every_metric_of_the_latest_evaluation_by_name(live: Cluster) -> None:
    """The built-in task reports accuracy and the loss; both series agree with the accuracy and loss gauges
    (a scrape may fall between the gauges' updates, hence waiting for one that holds all of them)."""

    def agreeing_scrape() -> dict[str, float] | None:
        text = live.procs[0].metrics()
        series = {
            name: float(value)
            for name, value in re.findall(r'^dynabatch_eval_metric\{name="([^"]*)"\} (\S+)$', text, re.M)
        }
        same = series.keys() == {"accuracy", "loss"} and (series["accuracy"], series["loss"]) == (
            metric_value(text, "dynabatch_job_test_accuracy"),
            metric_value(text, "dynabatch_job_test_loss"),
        )
        return series if same else None

    series = wait_for("dynabatch_eval_metric for accuracy and loss", agreeing_scrape, timeout_s=30)
    assert series["loss"] > 0 and 0 < series["accuracy"] <= 1
