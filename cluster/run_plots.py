"""The run folder's plots: what a user looks at to see whether the job learnt and whether the batches worked.

Two figures, both against seconds since the job's scheduler started, with the
moment training began marked:

- `loss_accuracy.png`: the smoothed training loss and each evaluation's loss on
  one axis, then one axis per scale of the other evaluation metrics (every
  metric whose values lie in [0, 1] shares one, any other metric gets its own).
  Evaluations are points, never joined: between two evaluations nothing was
  measured, and a short run's first and last evaluation joined by a line would
  draw a learning curve that never happened. A run with few evaluations labels
  each point with the model version it evaluated.
- `workers.png`: per worker, its batch (with its upper bound), its samples/s and
  its mean step time between two snapshots. Dynamic batching works when the step
  times meet; a worker's legend gives its name and slowdown as the console does, and its batch bound.

The title names the run folder, the model (or task), the workers and the
protocol, read from the run's config.json where there is one.
"""

from __future__ import annotations

import json
import math
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from dynabatch.cluster.report import evaluations, training_start
from dynabatch.cluster.worker_labels import emulated, label, order_key
from dynabatch.common.atomic_file import write_atomic
from dynabatch.common.wire.messages import JobStatus, WorkerStatus

X_LABEL = "seconds since the job's scheduler started"
NAN = float("nan")
MAX_VERSION_LABELS = 12  # beyond this many evaluations the labels would cover the points


def write_plots(run_dir: Path, timeline: list[JobStatus]) -> list[Path]:
    """Write loss_accuracy.png and workers.png into `run_dir`; returns their paths.

    Figures are made without pyplot (its import alone would cost every run CPU time, bench/RESULTS.md 16, and it
    keeps global state a figure needs no part of): a bare `Figure` renders PNG through Agg."""
    config = _config(run_dir)
    title = run_title(run_dir.name, config, timeline)
    paths = []
    for name, draw in (("loss_accuracy.png", _draw_evaluations), ("workers.png", _draw_workers)):
        fig = draw(timeline, config)
        fig.suptitle(title)
        fig.tight_layout()
        paths.append(run_dir / name)
        # a full disk leaves the previous plot, never half of one
        write_atomic(paths[-1], partial(fig.savefig, format="png", dpi=100))
    return paths


def _config(run_dir: Path) -> dict[str, Any]:
    """The run's config.json ({"run": ..., "job": ...}), or {} where a folder has none (a re-plot of a timeline)."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def run_title(name: str, config: dict[str, Any], timeline: list[JobStatus]) -> str:
    """`NAME: MODEL, N workers (slowdowns ...), PROTOCOL + POLICY batches`."""
    run, job, last = config.get("run", {}), config.get("job", {}), timeline[-1]
    model = run.get("task") or (f"{job['model']} on {job['dataset']}" if "model" in job else last.job)
    workers = len({w for s in timeline for w in s.workers})
    slowdowns = run.get("slowdowns")
    shape = f"{workers} workers" + (f" (slowdowns {' '.join(map(str, slowdowns))})" if slowdowns else "")
    return f"{name}: {model}, {shape}, {last.protocol} + {last.batch_policy} batches"


def legend_label(worker: WorkerStatus, show_slowdown: bool, job_max_batch: int) -> str:
    """`worker1(2x): batch <= 64`: its name and slowdown as the console shows them (cluster/worker_labels.py),
    and the largest batch it can get."""
    bound = batch_bound(worker.max_batch, job_max_batch)
    return f"{label(worker.name, worker.slowdown, show_slowdown)}: " + (
        f"batch <= {bound}" if bound else "no batch bound"
    )


def batch_bound(own: int, job: int) -> int:
    """The largest batch a worker can get: its own --max-batch and the job's, whichever is smaller (0: none)."""
    bounds = [b for b in (own, job) if b > 0]
    return min(bounds) if bounds else 0


def metric_axes(evals: list[JobStatus]) -> list[list[str]]:
    """The evaluation metrics other than the loss, grouped by scale: those whose every value lies in [0, 1]
    share one axis (accuracy, top-k, fractions), any other metric gets an axis of its own."""
    names = sorted({n for e in evals for n in e.metrics if n != "loss"})
    values = {n: [e.metrics[n] for e in evals if n in e.metrics and math.isfinite(e.metrics[n])] for n in names}
    fractions = [n for n in names if values[n] and all(0.0 <= v <= 1.0 for v in values[n])]
    return ([fractions] if fractions else []) + [[n] for n in names if n not in fractions]


def step_times(timeline: list[JobStatus], wid: str) -> tuple[list[float], list[float]]:
    """A worker's mean step time between consecutive snapshots (its cumulative step seconds over its steps
    in between), at the later one's time; NaN where it took no step, so a gap is drawn, not a line."""
    seen = [s for s in timeline if wid in s.workers]
    t, step = [], []
    for before, after in pairwise(seen):
        a, b = before.workers[wid], after.workers[wid]
        steps = b.observed_steps - a.observed_steps
        t.append(after.t)
        step.append((b.step_s_total - a.step_s_total) / steps if steps > 0 else NAN)
    return t, step


def _mark_training_start(ax: Any, timeline: list[JobStatus]) -> None:
    start = training_start(timeline)
    if start is not None:
        ax.axvline(start, color="grey", linestyle=":", linewidth=1, label="first batches")
    ax.set_xlabel(X_LABEL)
    ax.grid(alpha=0.3)


def _draw_evaluations(timeline: list[JobStatus], config: dict[str, Any]) -> Figure:
    evals = evaluations(timeline)
    groups = metric_axes(evals)
    fig = Figure(figsize=(5.5 * (1 + len(groups)), 4.2))
    axes = fig.subplots(1, 1 + len(groups), squeeze=False)
    loss_ax = axes[0][0]
    loss_ax.plot(
        [s.t for s in timeline],
        [NAN if s.loss is None else s.loss for s in timeline],
        ".-",
        markersize=3,
        label="train loss (smoothed)",
    )
    loss_ax.plot(
        [e.eval_t for e in evals],
        [NAN if e.test_loss is None else e.test_loss for e in evals],
        "o",
        label="evaluation loss",
    )
    loss_ax.set_ylabel("loss")
    for ax, names in zip(axes[0][1:], groups, strict=True):
        for name in names:
            ax.plot([e.eval_t for e in evals], [e.metrics.get(name, NAN) for e in evals], "o", label=name)
        ax.set_ylabel(names[0] if len(names) == 1 else "evaluation metrics in [0, 1]")
        if len(evals) <= MAX_VERSION_LABELS:
            _label_versions(ax, evals, names[0])
            ax.margins(y=0.12)  # room for the labels of the highest points
    for ax in axes[0]:
        _mark_training_start(ax, timeline)
        ax.legend(fontsize="small")
    return fig


def _label_versions(ax: Any, evals: list[JobStatus], name: str) -> None:
    """Each evaluation's model version beside its point: an evaluation is reported when the evaluator finishes,
    so on a busy machine the initial model's (v0) can land after training began."""
    for e in evals:
        value = e.metrics.get(name, NAN)
        if e.eval_version is not None and e.eval_t is not None and math.isfinite(value):
            ax.annotate(
                f"v{e.eval_version}", (e.eval_t, value), textcoords="offset points", xytext=(4, 4), fontsize="x-small"
            )


def _draw_workers(timeline: list[JobStatus], config: dict[str, Any]) -> Figure:
    fig = Figure(figsize=(16.5, 4.6))
    batch_ax, speed_ax, step_ax = fig.subplots(1, 3)
    job_bound = config.get("job", {}).get("max_batch", 0)
    finals = {wid: s.workers[wid] for s in timeline for wid in s.workers}  # each worker as last seen
    show_slowdown = emulated(w.slowdown for w in finals.values())
    for wid in sorted(finals, key=lambda w: order_key(finals[w].name, w)):
        seen = [s for s in timeline if wid in s.workers]
        final = finals[wid]
        legend = legend_label(final, show_slowdown, job_bound)
        t = [s.t for s in seen]
        line = batch_ax.step(t, [s.workers[wid].batch for s in seen], where="post", label=legend)[0]
        bound = batch_bound(final.max_batch, 0)  # the job's bound, common to all, is drawn once below
        if bound:
            batch_ax.axhline(bound, color=line.get_color(), linestyle="--", linewidth=1)
        speed_ax.plot(
            t, [s.workers[wid].samples_per_s for s in seen], ".-", markersize=3, color=line.get_color(), label=legend
        )
        step_t, step_s = step_times(timeline, wid)
        step_ax.plot(step_t, [1000 * s for s in step_s], ".-", markersize=4, color=line.get_color(), label=legend)
    if job_bound and any(s.workers and max(w.batch for w in s.workers.values()) > job_bound / 2 for s in timeline):
        batch_ax.axhline(job_bound, color="grey", linestyle="--", linewidth=1, label=f"job's --max-batch {job_bound}")
    batch_ax.set_ylabel("batch size (dashed: its bound)")
    speed_ax.set_ylabel("samples/s (last step)")
    step_ax.set_ylabel("mean step time between snapshots (ms)")
    step_ax.set_title("equal step times: the batches fit the speeds", fontsize="small")
    for ax in (batch_ax, speed_ax, step_ax):
        _mark_training_start(ax, timeline)
        ax.legend(fontsize="small")
    return fig
