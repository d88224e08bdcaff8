"""A real Prometheus scrapes a live `dynabatch run`; every Grafana dashboard query returns data.

The run writes `prometheus_targets.json` (file_sd); Prometheus (the Debian package)
scrapes it every second on 127.0.0.1, and each PromQL expression of
k8s/base/dashboard.json, its variables filled in as Grafana would, is asked through
the HTTP API: per-worker panels must return a series for every training worker of
the run, the others at least one series.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq

from hang_guard import hang_guard_s
from harness import free_port, interrupt, wait_for
from tools import need_tool

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[1] / "k8s" / "base" / "dashboard.json"
JOB = "dynabatch"
WORKERS = 2
# Grafana's $__rate_interval for a 1 s scrape interval: four scrapes, plus one.
RATE_INTERVAL = "5s"


def dashboard_queries() -> list[tuple[str, str, bool]]:
    """(panel title, expression with the variables filled in, whether it is per worker)."""
    d = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in d["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    out = []
    for p in panels:
        for t in p.get("targets", []):
            expr, legend = t["expr"], t.get("legendFormat", "")
            per_worker = "{{worker}}" in legend or "$worker" in expr or re.search(r"by \([^)]*\bworker\b", expr)
            expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$job", JOB).replace("$worker", ".+")
            out.append((p["title"], expr, bool(per_worker)))
    return out


def _get(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = _get(port, "/api/v1/query", query=expr)["result"]
    return result


def _targets_up(port: int) -> bool:
    try:
        active = _get(port, "/api/v1/targets")["activeTargets"]
    except OSError:
        return False
    return len(active) == WORKERS + 3 and all(t["health"] == "up" for t in active)


def _one_bad_message(endpoint: str) -> None:
    """Garbage to the scheduler: the `Bad messages` panel shows rejected input, which a clean run has none of."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"not msgpack"])
        assert sock.poll(10_000), "the scheduler answers garbage with ERROR"
    finally:
        ctx.destroy(linger=0)


def test_every_dashboard_query_returns_series_for_every_worker(tmp_path: Path) -> None:
    """The workers idle most of each step (--slowdowns 4 8): the queries need series, not speed, and the job
    runs until every query has answered."""
    prometheus_bin = need_tool("prometheus", "apt-get install -y prometheus")
    run_log = (tmp_path / "run.log").open("wb")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynabatch.cli.main",
            "run",
            "--out",
            str(tmp_path),
            "--name",
            "r",
            "--dataset",
            "synthetic",
            "--model",
            "mlp",
            "--epochs",
            "1000",
            "--workers",
            str(WORKERS),
            "--slowdowns",
            "4",
            "8",
            "--eval-interval-s",
            "2",
            "--checkpoint-interval-s",
            "3",
            "--job",
            JOB,
            "--no-plots",
        ],
        stdout=run_log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    prometheus = None
    try:
        targets = tmp_path / "r" / "prometheus_targets.json"
        wait_for("the run's file_sd targets", targets.exists, timeout_s=60)
        listed = json.loads(targets.read_text())
        assert {t["labels"]["job"] for t in listed} == {JOB}, "Prometheus' job label is the job's name"
        config = tmp_path / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "dynabatch-local",
                            "scrape_timeout": "1s",
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                        }
                    ],
                }
            )
        )
        port = free_port()
        prometheus = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("wb"),
        )
        wait_for("every process's /metrics to be scraped and up", lambda: _targets_up(port), timeout_s=60)

        def training_workers() -> set[str]:
            series = _query(port, f'dynabatch_worker_steps_total{{job="{JOB}", role="worker"}} > 0')
            found = {s["metric"]["worker"] for s in series}
            return found if len(found) == WORKERS else set()

        workers = wait_for("every worker to be training", training_workers, timeout_s=60)
        _one_bad_message(_scheduler_endpoint(tmp_path / "r" / "logs" / "scheduler.log"))

        # The dashboard's variables, as Grafana lists them.
        assert JOB in _get(port, "/api/v1/label/job/values", **{"match[]": "dynabatch_job_epoch"})
        assert (
            set(
                _get(
                    port, "/api/v1/label/worker/values", **{"match[]": f'dynabatch_worker_step_seconds{{job=~"{JOB}"}}'}
                )
            )
            == workers
        )

        queries = dashboard_queries()
        assert len(queries) > 20

        def missing() -> list[str]:
            out = []
            for title, expr, per_worker in queries:
                result = _query(port, expr)
                if per_worker:
                    got = {s["metric"].get("worker") for s in result}
                    if not workers <= got:
                        out.append(f"{title}: {expr} -> workers {sorted(got, key=str)}, want {sorted(workers)}")
                elif not result:
                    out.append(f"{title}: {expr} -> no series")
            return out

        last: list[list[str]] = []

        def all_answered() -> bool:
            last[:] = [missing()]
            return not last[0]

        try:
            wait_for("every dashboard query to return its series", all_answered, timeout_s=60, every_s=1.0)
        except AssertionError as exc:
            raise AssertionError("\n".join([str(exc), *last[0]])) from None
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(hang_guard_s(30))
        interrupt(run)
        run_log.close()


def _scheduler_endpoint(log: Path) -> str:
    """The scheduler's control endpoint, from its first log line."""
    text = wait_for(
        "the scheduler's endpoint in its log",
        lambda: re.search(r"at (tcp://[0-9.]+:\d+)", log.read_text(errors="replace")),
        timeout_s=30,
    )
    return text.group(1)
