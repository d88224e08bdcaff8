"""`--target-metric METRIC>=VALUE | METRIC<=VALUE`: parsed at start-up, reported as time to target at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dynabatch.cluster.main import format_summary
from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.cluster.options import RunOptions
from dynabatch.common.flags import ConfigError
from harness import run_job

TASKS = Path(__file__).parent / "tasks"


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("accuracy>=0.9", MetricTarget("accuracy", ">=", 0.9)),
        ("loss<=0.3", MetricTarget("loss", "<=", 0.3)),
        (" top-5 acc >= 95e-2 ", MetricTarget("top-5 acc", ">=", 0.95)),
        ("loss<=-1", MetricTarget("loss", "<=", -1.0)),
    ],
)
def test_a_target_names_any_metric_a_direction_and_a_value(text: str, parsed: MetricTarget) -> None:
    assert MetricTarget.parse(text) == parsed
    assert MetricTarget.parse(str(parsed)) == parsed


@pytest.mark.parametrize(
    "text, why",
    [
        ("accuracy>0.9", "is not METRIC>=VALUE"),
        ("accuracy=0.9", "is not METRIC>=VALUE"),
        ("accuracy", "is not METRIC>=VALUE"),
        (">=0.9", "1 to 64 characters"),
        ("accuracy>=high", "'high' is not a number"),
        ("accuracy>=>=0.9", "'>=0.9' is not a number"),
        ("loss<=nan", "must be finite"),
        ("loss<=inf", "must be finite"),
        ("x" * 65 + ">=1", "1 to 64 characters"),
    ],
)
def test_a_malformed_target_is_refused_naming_the_flag(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match="--target-metric") as refused:
        RunOptions(target_metric=text).validate()
    assert why in str(refused.value)


@pytest.mark.parametrize(
    "target, value, met",
    [
        ("accuracy>=0.9", 0.9, True),
        ("accuracy>=0.9", 0.89, False),
        ("loss<=0.3", 0.3, True),
        ("loss<=0.3", 0.31, False),
        ("loss<=0.3", math.nan, False),
        ("loss<=0.3", None, False),
    ],
)
def test_a_target_is_met_at_its_value_in_its_direction_and_never_by_a_missing_one(
    target: str, value: float | None, met: bool
) -> None:
    assert MetricTarget.parse(target).met(value) is met


def _summary(**kw: Any) -> dict[str, Any]:
    return {
        "finished": True,
        "final_test_acc": 0.91,
        "final_metrics": {"accuracy": 0.91, "loss": 0.3},
        "wall_s": 10.0,
        "epochs": 1.0,
        "samples_per_s": 100.0,
        "fraction_of_compute_speed": 0.5,
        "fraction_of_standalone": 0.5,
        "workers": {},
        "step_time_spread": None,
        "target_metric": None,
        "time_to_target_s": None,
        **kw,
    }


@pytest.mark.parametrize(
    "target, seconds, line",
    [
        ("accuracy>=0.9", 12.34, "time to accuracy>=0.9: 12.3 s of training"),
        ("accuracy>=0.95", None, "accuracy>=0.95 not reached\n"),
        ("recall>=0.5", None, "recall>=0.5 not reached: the evaluations report accuracy, loss, not recall"),
    ],
)
def test_the_end_of_run_lines_give_the_time_to_target_or_why_there_is_none(
    target: str, seconds: float | None, line: str
) -> None:
    text = format_summary(_summary(target_metric=target, time_to_target_s=seconds), Path("runs/r"))
    assert line in text
    untargeted = format_summary(_summary(), Path("runs/r"))
    assert "not reached" not in untargeted and "time to" not in untargeted


@pytest.mark.slow
def test_a_run_reports_the_time_to_its_target_on_a_metric_of_the_users_task(tmp_path: Path) -> None:
    run, printed = run_job(
        tmp_path,
        "r",
        "--task",
        f"{TASKS / 'blobs.py'}:task",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "1",
        "--epochs",
        "3",
        "--global-batch",
        "64",
        "--eval-interval-s",
        "1",
        "--target-metric",
        "top2>=0.9",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["target_metric"] == "top2>=0.9" and summary["final_metrics"]["top2"] >= 0.9, summary
    seconds = summary["time_to_target_s"]
    assert seconds is not None and math.isfinite(seconds) and 0 < seconds <= summary["wall_s"], summary
    assert f"time to top2>=0.9: {seconds:.1f} s of training" in printed
    assert json.loads((run / "config.json").read_text())["run"]["target_metric"] == "top2>=0.9"


def test_the_end_of_run_lines_show_an_idle_worker_without_a_step_and_each_workers_discarded_steps() -> None:
    worker = {
        "name": "worker0",
        "slowdown": "1x",
        "final_batch": 64,
        "mean_step_s_after_warmup": 0.02,
        "mean_data_s_after_warmup": 0.001,
        "compute_samples_per_s": 3000.0,
        "standalone_samples_per_s": 3000.0,
        "discarded": 0,
    }
    idle = {**worker, "name": "worker1", "slowdown": "4x", "final_batch": 0, "mean_step_s_after_warmup": None}
    idle |= {"mean_data_s_after_warmup": None, "discarded": 9}
    lines = format_summary(_summary(workers={"w0": worker, "w1": idle}), Path("runs/r")).splitlines()
    shown = {line.split()[0]: line for line in lines if line.startswith("  worker")}
    assert "step    20.0 ms (data   1.0 ms)" in shown["worker0(1x)"] and "discarded" not in shown["worker0(1x)"]
    assert "step       -    (data     -   )" in shown["worker1(4x)"] and "nan" not in shown["worker1(4x)"]
    assert shown["worker1(4x)"].endswith("discarded 9 steps")
