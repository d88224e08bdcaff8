"""The scheduler's progress line: due every --log-every-s once samples are trained, with the speed between two."""

from __future__ import annotations

import math

from dynabatch.scheduler.progress_log import ProgressLog
from dynabatch.scheduler.progress_watch import measured_eval_s


def test_a_progress_line_is_due_every_interval_once_training_began_and_gives_the_speed_since_the_last() -> None:
    plog = ProgressLog(10.0)
    assert plog.line(0.0, 0, 0.0, 2.0, 3, math.nan) == "", "nothing trained yet: no line"
    assert plog.line(1.0, 500, 0.05, 2.0, 3, math.nan) == "epoch 0.05/2 (500 samples), 3 worker(s) live"
    assert plog.line(10.9, 5000, 0.5, 2.0, 3, 0.5) == "", "not due before the interval"
    assert (
        plog.line(11.0, 5500, 0.55, 2.0, 2, 0.25)
        == "epoch 0.55/2 (5500 samples, 500 samples/s), 2 worker(s) live, loss 0.2500"
    )


def test_no_progress_lines_with_an_interval_of_zero() -> None:
    assert ProgressLog(0.0).line(100.0, 500, 0.05, 2.0, 3, 0.1) == ""


def test_an_evaluators_evaluation_time_is_measured_from_when_its_reports_arrive() -> None:
    assert measured_eval_s(0.0, 7.0, 10.0, first=True) == 7.0, "loading and the first evaluation: an upper bound"
    assert measured_eval_s(7.0, 10.5, 10.0, first=False) == 0.5, "an interval after the last, plus the evaluation"
    assert measured_eval_s(0.5, 0.6, 10.0, first=False) == 0.5, "a report sooner than the interval measures nothing"
