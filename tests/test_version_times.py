"""When a model version existed (scheduler/version_times.py), and time to accuracy counted to it.

Driven directly, then one real job whose evaluator takes seconds: its time to accuracy is the time the
evaluated model existed at the shards, and the time the evaluation was reported is kept beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dynabatch.cluster.report import evaluations, read_timeline, summarize, training_start
from dynabatch.common.wire.messages import JobStatus
from dynabatch.scheduler.version_times import MAX_KEPT, VersionTimes
from harness import run_job
from test_report import _snap

TASKS = Path(__file__).parent / "tasks"
sys.path.insert(0, str(TASKS))
from blobs_slow_eval import EVAL_IDLE_S  # noqa: E402


def test_a_version_existed_when_the_shards_first_reported_it_or_one_past_it() -> None:
    times = VersionTimes()
    for version, t in ((0, 0.0), (3, 1.0), (3, 1.5), (7, 2.0), (9, 3.0)):
        times.observe(version, t)
    assert times.time_of(3, reported_t=5.0) == 1.0, "its first report, not a repeat"
    assert times.time_of(5, reported_t=5.0) == 2.0, "a version between two reports existed by the next"
    assert times.time_of(10, reported_t=5.0) == 5.0, "evaluated before any heartbeat showed it: when reported"
    assert times.time_of(3, reported_t=0.5) == 0.5, "never later than its evaluation arrived"


def test_a_rollback_forgets_the_versions_of_the_abandoned_model() -> None:
    times = VersionTimes()
    for version, t in ((2, 1.0), (6, 2.0), (9, 3.0), (4, 4.0), (6, 5.0)):
        times.observe(version, t)
    assert times.time_of(6, reported_t=9.0) == 5.0, "version 6 of the restored model, not the diverged one's"
    assert times.time_of(4, reported_t=9.0) == 4.0, "the shards are back at version 4 since the rollback"
    assert times.time_of(2, reported_t=9.0) == 1.0, "versions below the restored one are kept"


def test_the_record_is_bounded_and_an_older_version_is_placed_no_later_than_the_oldest_kept() -> None:
    times = VersionTimes()
    for version in range(MAX_KEPT + 10):
        times.observe(version, float(version))
    assert len(times.versions) == MAX_KEPT
    assert times.time_of(3, reported_t=1e9) == 10.0


def test_the_summary_counts_to_the_model_and_keeps_the_reported_time() -> None:
    timeline = [_snap(1.0, 0, 0.0), _snap(9.0, 4000, 8.0, acc=0.86, eval_t=8.5)]
    timeline[-1].eval_model_t = 6.0
    s = summarize(timeline, wall_s=10.0, warmup_fraction=0.0)
    assert s["time_to_accuracy_s"]["0.85"] == pytest.approx(5.0)
    assert s["time_to_accuracy_reported_s"]["0.85"] == pytest.approx(7.5)


def _model_version(snap: JobStatus) -> int | None:
    return min((sh.version for sh in snap.shards.values()), default=None)


@pytest.mark.slow
def test_time_to_accuracy_is_when_the_evaluated_model_existed_not_when_its_slow_evaluation_arrived(
    tmp_path: Path,
) -> None:
    """The evaluator idles EVAL_IDLE_S in every evaluation (tests/tasks/blobs_slow_eval.py): the hit's model
    existed at the shards before the evaluator pulled it, and the scheduler learned so within a heartbeat
    (0.5 s), so the reported time is later by at least half the idle."""
    run, _ = run_job(
        tmp_path,
        "r",
        "--task",
        f"{TASKS / 'blobs_slow_eval.py'}:task",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "--epochs",
        "40",
        "--eval-interval-s",
        "0.1",
        "--status-s",
        "0.2",
        timeout_s=240,
    )
    summary = json.loads((run / "summary.json").read_text())
    timeline = read_timeline(run / "timeline.json")
    start = training_start(timeline)
    hit = next(e for e in evaluations(timeline) if (e.test_acc or 0.0) >= 0.85)
    assert hit.eval_model_t is not None and hit.eval_t is not None and hit.eval_version is not None
    assert start is not None
    assert summary["time_to_accuracy_s"]["0.85"] == pytest.approx(max(0.0, hit.eval_model_t - start))
    assert summary["time_to_accuracy_reported_s"]["0.85"] == pytest.approx(hit.eval_t - start)
    assert hit.eval_t - hit.eval_model_t >= EVAL_IDLE_S / 2, (hit.eval_t, hit.eval_model_t)
    before = [v for s in timeline if s.t < hit.eval_model_t if (v := _model_version(s)) is not None]
    assert before and all(v < hit.eval_version for v in before), (
        "no snapshot before the model's time shows the shards at its version"
    )
    after = [v for s in timeline if hit.eval_model_t <= s.t if (v := _model_version(s)) is not None]
    assert after and after[0] >= hit.eval_version
