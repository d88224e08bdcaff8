"""The run folder's plots: titles and legends that say what ran, one axis per metric scale, step times per worker."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dynabatch.cluster.report import plot
from dynabatch.cluster.run_plots import batch_bound, legend_label, metric_axes, run_title, step_times
from dynabatch.common.wire.messages import JobStatus, WorkerStatus

CONFIG: dict[str, Any] = {
    "run": {"slowdowns": ["1", "2", "4"], "task": ""},
    "job": {"model": "cnn", "dataset": "fashion-mnist", "max_batch": 1024},
}


def _status(
    t: float, steps: int, step_s_total: float, metrics: dict[str, float] | None = None, eval_t: float | None = None
) -> JobStatus:
    worker = WorkerStatus(name="worker1", batch=32, observed_steps=steps, step_s_total=step_s_total, max_batch=64)
    return JobStatus(
        t=t,
        job="dynabatch",
        protocol="asgd",
        batch_policy="dynamic",
        loss=1.0,
        training_t=t - 1.0,
        workers={"w0": worker},
        metrics=metrics or {},
        eval_t=eval_t,
        eval_version=steps,
        test_loss=(metrics or {}).get("loss"),
    )


def test_the_title_names_the_run_the_model_the_workers_and_the_protocol() -> None:
    title = run_title("exp1", CONFIG, [_status(1.0, 0, 0.0)])
    assert title == "exp1: cnn on fashion-mnist, 1 workers (slowdowns 1 2 4), asgd + dynamic batches"
    with_task = {"run": {**CONFIG["run"], "task": "my_task.py:task"}, "job": CONFIG["job"]}
    assert "my_task.py:task" in run_title("exp1", with_task, [_status(1.0, 0, 0.0)])


def test_a_workers_legend_gives_its_name_and_slowdown_as_the_console_does_and_its_batch_bound() -> None:
    assert legend_label(WorkerStatus(name="worker2", slowdown="4x"), True, 1024) == "worker2(4x): batch <= 1024"
    assert (
        legend_label(WorkerStatus(name="worker1", slowdown="2x", max_batch=64), True, 1024)
        == "worker1(2x): batch <= 64"
    )
    assert legend_label(WorkerStatus(name="gpu-a", slowdown="1x"), False, 0) == "gpu-a: no batch bound"
    assert batch_bound(0, 0) == 0 and batch_bound(2048, 1024) == 1024


def test_metrics_of_different_scales_get_axes_of_their_own() -> None:
    evals = [
        _status(2.0, 0, 0.0, {"loss": 2.3, "accuracy": 0.1, "top2": 0.2, "bits_per_byte": 7.9}, 2.0),
        _status(9.0, 0, 0.0, {"loss": 0.4, "accuracy": 0.9, "top2": 0.97, "bits_per_byte": float("nan")}, 9.0),
    ]
    assert metric_axes(evals) == [["accuracy", "top2"], ["bits_per_byte"]]


def test_step_times_are_means_between_snapshots_with_a_gap_where_no_step_was_taken() -> None:
    timeline = [_status(1.0, 0, 0.0), _status(2.0, 10, 0.5), _status(3.0, 10, 0.5), _status(4.0, 14, 0.9)]
    t, step = step_times(timeline, "w0")
    assert t == [2.0, 3.0, 4.0]
    assert step[0] == 0.05 and math.isnan(step[1]) and abs(step[2] - 0.1) < 1e-12


def test_plot_writes_both_figures_from_a_run_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    timeline = [
        _status(1.0, 0, 0.0, {"loss": 2.3, "accuracy": 0.1}, 1.0),
        _status(2.0, 10, 0.5),
        _status(3.0, 20, 1.0, {"loss": 0.5, "accuracy": 0.8}, 3.0),
    ]
    paths = plot(tmp_path, timeline)
    assert [p.name for p in paths] == ["loss_accuracy.png", "workers.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
