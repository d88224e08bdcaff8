"""An evaluator whose main thread hangs while its heartbeat thread beats on does not hold the job's end.

`dynabatch run` on tests/tasks/wedged_eval.py: every evaluator process makes one real
evaluation, then hangs in its test set. The scheduler drops it for making no
progress (its interval plus three of its measured evaluations, at least three
liveness timeouts, at most the join timeout), the process ends itself once its main
thread has not registered again within the join timeout, and the run starts it
afresh; the job ends with its final evaluation given up, saying why, and with the
accuracy of the last real evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import run_job

pytestmark = pytest.mark.slow
SPEC = f"{Path(__file__).resolve().parent / 'tasks' / 'wedged_eval.py'}:task"
INTERVAL_S, LIVENESS_S, JOIN_S, RESTARTS = 0.5, 1.0, 3.0, 3


def test_a_wedged_evaluator_is_dropped_restarted_and_the_job_ends_without_its_final_evaluation(tmp_path: Path) -> None:
    # Training goes on past the first evaluator's drop and its restart; an idled worker keeps its CPU low.
    run, out = run_job(
        tmp_path,
        "r",
        "--task",
        SPEC,
        "--workers",
        "1",
        "--slowdowns",
        "10",
        "--epochs",
        "1000",
        "--time-budget-s",
        "8",
        "--eval-interval-s",
        str(INTERVAL_S),
        "--heartbeat-s",
        "0.2",
        "--liveness-timeout-s",
        str(LIVENESS_S),
        "--join-timeout-s",
        str(JOIN_S),
        "--restarts",
        str(RESTARTS),
        timeout_s=150,
    )
    summary = json.loads((run / "summary.json").read_text())
    given_up = summary["final_evaluation"] or ""
    assert summary["finished"] and not summary["final_eval"], summary
    assert given_up.startswith("given up: evaluator ") and "reported no evaluation for" in given_up, given_up
    assert summary["final_test_acc"] is not None and summary["final_eval_version"] is not None, (
        "the accuracy is the last real evaluation's"
    )
    assert f"final evaluation {given_up}" in out

    evaluator_log = (run / "logs" / "evaluator.log").read_text()
    assert "its main thread has not registered again: it hangs" in evaluator_log
    assert "restarted by the launcher" in evaluator_log, "the run started the wedged evaluator afresh"
    scheduler_log = (run / "logs" / "scheduler.log").read_text()
    assert "dropped; the job's end does not wait for it" in scheduler_log
    assert "final evaluation given up: evaluator" in scheduler_log

    # From the job's stop to its end: each evaluator it met is dropped within its interval plus the join timeout
    # (the most an evaluation may be allowed), and with none left the job waits the join timeout for one.
    timeline = json.loads((run / "timeline.json").read_text())
    stopped = min(s["t"] for s in timeline if s["stopping"])
    finished = min(s["t"] for s in timeline if s["finished"])
    assert finished - stopped <= (RESTARTS + 1) * (INTERVAL_S + JOIN_S) + JOIN_S, (stopped, finished)
