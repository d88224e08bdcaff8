"""The run folder: timeline (JSON and CSV), PNG plots, summary.json.

The timeline is a list of the scheduler's STATUS snapshots, stamped with
seconds since the run began. Everything here is computed from it, so a run can
be re-plotted from timeline.json alone (`read_timeline`). The files hold each
snapshot as a map keyed by the field names of `JobStatus` (plus `wall_t`):
the benchmarks and other tools read them by those keys.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.cluster.worker_labels import order_key
from dynabatch.common import staleness
from dynabatch.common.atomic_file import write_text_atomic
from dynabatch.common.wire.frames import decode_map
from dynabatch.common.wire.messages import JobStatus
from dynabatch.common.wire.step_times import StepTimes

ACCURACY_MARKS = (0.85, 0.88)
STEP_COLUMNS = tuple(f.name for f in fields(StepTimes))  # a worker's `times`, flat in the CSV under their names
WORKER_COLUMNS = ("batch", "samples_per_s", *STEP_COLUMNS, "samples", "name", "slowdown")
# timeline.csv's name for each of a row's worker columns: the worker's samples beside the job's own `samples`
WORKER_HEADER = tuple("worker_samples" if c == "samples" else c for c in WORKER_COLUMNS)


@dataclass
class Snapshot:
    """One STATUS reply as `dynabatch run` sampled it, stamped with the run's own clock."""

    status: JobStatus
    wall_t: float

    def to_json(self) -> dict[str, Any]:
        """The timeline.json entry: the status's fields, then `wall_t`."""
        return {**asdict(self.status), "wall_t": self.wall_t}


def write_timeline(run_dir: Path, timeline: list[Snapshot]) -> None:
    """timeline.json (whole snapshots) and timeline.csv (one row per snapshot and worker)."""
    write_text_atomic(run_dir / "timeline.json", json.dumps([snap.to_json() for snap in timeline]))
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["t", "epoch", "samples", "loss", "test_acc", "test_loss", "worker", *WORKER_HEADER])
    for snap in timeline:
        s = snap.status
        head = [round(s.t, 3), s.epoch, s.samples, s.loss, s.test_acc, s.test_loss]
        if not s.workers:
            w.writerow(head + [""] * (1 + len(WORKER_COLUMNS)))
        for wid, info in sorted(s.workers.items(), key=lambda item: order_key(item[1].name, item[0])):
            w.writerow(head + [wid] + [getattr(info.times if c in STEP_COLUMNS else info, c) for c in WORKER_COLUMNS])
    write_text_atomic(run_dir / "timeline.csv", table.getvalue())


def read_timeline(path: Path) -> list[JobStatus]:
    """The statuses of a timeline.json that `write_timeline` wrote, checked as a STATUS reply is (ProtocolError
    if not)."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path} does not hold a list of snapshots")
    if any(_flat_times(entry) for entry in entries):
        raise ValueError(
            f"{path} was written by a dynabatch before protocol 4 (its workers' step times are not under `times`): "
            "read it with the version that wrote it"
        )
    return [decode_map(JobStatus, entry, f"{path.name}[{i}]") for i, entry in enumerate(entries)]


def _flat_times(entry: object) -> bool:
    """Whether a snapshot holds a worker whose step times sit beside its other fields (protocol 3's STATUS) rather
    than in `times`: decoded as it is, every time of such a worker would read 0."""
    workers = entry.get("workers") if isinstance(entry, dict) else None
    return isinstance(workers, dict) and any(
        isinstance(w, dict) and "step_s" in w and "times" not in w for w in workers.values()
    )


def summarize(
    timeline: list[JobStatus], wall_s: float, warmup_fraction: float, target: MetricTarget | None = None
) -> dict[str, Any]:
    """Final metrics, time to `target` and to the accuracy marks, throughput, and per-worker batch, step time and speed
    (the workers in cluster/worker_labels.py's order).

    Two yardsticks for throughput: the standalone speeds the workers probed at
    start-up, and their compute-only speeds during the run (samples over seconds
    of forward/backward, slowdown included). On a machine whose cores the workers
    share, the second is what each worker could do alone under the same
    contention, so the fraction of it is the share of time the protocol spends
    communicating or waiting.

    A worker's mean step time is the difference of its cumulative step seconds
    over the difference of its steps between the end of warm-up and its last
    snapshot, so every step after warm-up counts once however often we sampled;
    so is its mean time waiting for data (part of the step: a starved loader).
    """
    if not timeline:
        return {"wall_s": wall_s, "error": "no status was ever received from the scheduler"}
    last = timeline[-1]
    evals = [s for s in timeline if s.eval_t is not None]
    final_eval = evals[-1] if evals else None
    start_t = next((s.t for s in timeline if s.workers), timeline[0].t)
    before_stop = [s for s in timeline if not s.stopping]
    at_stop = (before_stop[-1] if before_stop else last).workers
    warm_t = start_t + warmup_fraction * (last.t - start_t)
    workers: dict[str, Any] = {}
    names = {wid: s.workers[wid].name for s in timeline for wid in s.workers}
    for wid in sorted(names, key=lambda w: order_key(names[w], w)):
        seen = [s for s in timeline if wid in s.workers]
        first = next((s for s in seen if s.t >= warm_t), seen[0]).workers[wid]
        final = seen[-1].workers[wid]
        departed = last.departed.get(wid)
        settled = settled_batch(wid, seen)
        steps = final.observed_steps - first.observed_steps
        mean_step = (final.step_s_total - first.step_s_total) / steps if steps > 0 else None
        mean_data = (final.data_s_total - first.data_s_total) / steps if steps > 0 else None
        workers[wid] = {
            "name": final.name,
            "slowdown": final.slowdown,
            "final_batch": settled,
            "max_batch": final.max_batch,
            "mean_step_s_after_warmup": mean_step,
            "mean_data_s_after_warmup": mean_data,
            "steps_after_warmup": steps,
            "standalone_samples_per_s": final.standalone_sps,
            "compute_samples_per_s": final.observed_samples / final.compute_s_total if final.compute_s_total else None,
            # Its last step and its leaving can fall between two snapshots: the totals it left with are final.
            "samples": departed.samples if departed else final.samples,
            "discarded": departed.discarded if departed else final.discarded,
            "left_early": wid not in at_stop,
        }
    # Throughput counts from the first batches to the first snapshot with the samples the job had when it began
    # stopping: start-up (standalone probes, waiting for every worker), the shards' confirmation of the end
    # (the workers idle once the budget is trained) and the final evaluation are not training.
    begin = training_start(timeline)
    stop = next((s for s in timeline if s.stopping), last)
    end = next(s for s in timeline if s.samples >= stop.samples)
    train_s = max(1e-9, end.t - (start_t if begin is None else begin))
    samples_per_s = end.samples / train_s
    stale = staleness.stats(last.staleness)
    step_means = [
        w["mean_step_s_after_warmup"] for w in workers.values() if w["mean_step_s_after_warmup"] and not w["left_early"]
    ]
    standalone = sum(w["standalone_samples_per_s"] for w in workers.values() if not w["left_early"])
    compute = sum(w["compute_samples_per_s"] or 0.0 for w in workers.values() if not w["left_early"])
    return {
        "protocol": last.protocol,
        "batch_policy": last.batch_policy,
        "auto_policy": last.auto_policy or None,
        "auto_reason": last.auto_reason or None,
        "auto_protocol": last.auto_protocol or None,
        "auto_protocol_reason": last.auto_protocol_reason or None,
        "final_test_acc": final_eval.test_acc if final_eval else None,
        "final_test_loss": final_eval.test_loss if final_eval else None,
        "final_metrics": dict(final_eval.metrics) if final_eval else {},
        "final_eval_version": final_eval.eval_version if final_eval else None,
        "final_eval_t": final_eval.eval_t if final_eval else None,
        # The shards' heartbeats lag: an evaluation may already name a newer model.
        "model_version": max([last.eval_version or 0, *(sh.version for sh in last.shards.values())]),
        "final_train_loss": last.loss,
        "epochs": last.epoch,
        **epochs_trained(last),
        "samples": last.samples,
        "wall_s": wall_s,
        "train_s": train_s,
        "samples_per_s": samples_per_s,
        "bytes_per_sample": last.bytes / max(1, last.samples),
        "updates": stale.updates,
        "discarded": discarded_pushes(timeline),
        "staleness_mean": stale.mean,
        "staleness_p99": stale.p99,
        "time_to_accuracy_s": time_to_accuracy(timeline, ACCURACY_MARKS),
        "time_to_accuracy_reported_s": time_to_accuracy(timeline, ACCURACY_MARKS, reported=True),
        "target_metric": str(target) if target else None,
        "time_to_target_s": time_to_target(timeline, target) if target else None,
        "time_to_target_reported_s": time_to_target(timeline, target, reported=True) if target else None,
        "budget_spent": last.budget_spent,
        "decision_s": asdict(last.decision_s),
        "local_steps": last.local_steps,
        "sum_standalone_samples_per_s": standalone,
        "fraction_of_standalone": samples_per_s / standalone if standalone else None,
        "sum_compute_samples_per_s": compute,
        "fraction_of_compute_speed": samples_per_s / compute if compute else None,
        "step_time_spread": (max(step_means) / min(step_means) - 1.0) if len(step_means) > 1 else None,
        "warmup_s": warm_t - start_t,
        "finished": last.finished,
        "final_eval": last.final_eval,
        "final_evaluation": f"given up: {last.final_eval_given_up}" if last.final_eval_given_up else None,
        "workers": workers,
        "decisions": [asdict(d) for d in last.decisions],
        "rollbacks": [asdict(rb) for rb in last.rollbacks],
        "lr_factor": last.lr_factor,
        "failed": last.failed or None,
    }


def settled_batch(wid: str, seen: list[JobStatus]) -> int:
    """The batch the run settled on for worker `wid`, from the snapshots it is in before the job began stopping (a
    worker that leaves first hands its share to the others for their last steps): the last before the job's budget
    was all allotted (past it a batch is what the worker's allotment leaves, down to 0, while the shards confirm
    the end); in a job allotted whole from its start, the last in which it held a batch."""
    before = [s for s in seen if not s.stopping] or seen
    allotting = [s for s in before if s.unallotted and s.training_t is not None]
    holding = [s for s in before if s.workers[wid].batch]
    return (allotting or holding or before)[-1].workers[wid].batch


def epochs_trained(last: JobStatus) -> dict[str, Any]:
    """The epochs asked for and trained (counted from the samples the model holds), and the samples trained past
    the epochs asked (negative: short of them, as a job stopped by its time budget or a failure ends)."""
    if not last.train_size:
        return {"epochs_requested": last.target_epochs, "epochs_trained": None, "overshoot_samples": None}
    asked = math.ceil(last.target_epochs * last.train_size)
    return {
        "epochs_requested": last.target_epochs,
        "epochs_trained": last.epoch,
        "overshoot_samples": last.samples - last.lost_samples - asked,
    }


def discarded_pushes(timeline: list[JobStatus]) -> int:
    """Pushes the shards discarded as too stale (ringmaster, rennala): each shard slot's highest count seen (the
    shards leave STATUS at the end, and a restarted shard counts afresh)."""
    highest: dict[str, int] = {}
    for snap in timeline:
        for slot, shard in snap.shards.items():
            highest[slot] = max(highest.get(slot, 0), shard.discarded)
    return sum(highest.values())


def training_start(timeline: list[JobStatus]) -> float | None:
    """The scheduler-clock time the first batches were handed out, or None if they never were."""
    snap = next((s for s in timeline if s.training_t is not None), None)
    return None if snap is None or snap.training_t is None else snap.t - snap.training_t


def time_to_accuracy(
    timeline: list[JobStatus], marks: tuple[float, ...], reported: bool = False
) -> dict[str, float | None]:
    """Seconds from the start of training to the first evaluation at or above each accuracy mark, by mark
    (`time_to_target`)."""
    return {f"{mark:g}": time_to_target(timeline, MetricTarget("accuracy", ">=", mark), reported) for mark in marks}


def time_to_target(timeline: list[JobStatus], target: MetricTarget, reported: bool = False) -> float | None:
    """Seconds from the first batches to when the model of the first evaluation that meets `target` existed at
    the shards, or (`reported`) to when that evaluation was reported, one evaluation later. None if none met it,
    or if training never began; 0 if the model met it before training, as the evaluator's first look can."""
    start = training_start(timeline)
    hit = next((e for e in evaluations(timeline) if target.met(metric_value(e, target.name))), None)
    if hit is None or hit.eval_t is None or start is None:
        return None
    at = hit.eval_t if reported or hit.eval_model_t is None else hit.eval_model_t
    return max(0.0, at - start)


def metric_value(status: JobStatus, name: str) -> float | None:
    """Metric `name` of the evaluation in `status`; accuracy and loss also from their own fields,
    which a report without a metrics map (an older evaluator's) still fills."""
    if name in status.metrics:
        return status.metrics[name]
    return {"accuracy": status.test_acc, "loss": status.test_loss}.get(name)


def plot(run_dir: Path, timeline: list[JobStatus]) -> list[Path]:
    """The run folder's PNG plots (cluster/run_plots.py, imported here so that matplotlib loads only when a run
    is plotted)."""
    from dynabatch.cluster.run_plots import write_plots

    return write_plots(run_dir, timeline)


def evaluations(timeline: list[JobStatus]) -> list[JobStatus]:
    """One point per evaluation, at the time it was reported (snapshots repeat the latest one)."""
    seen: dict[float, JobStatus] = {}
    for snap in timeline:
        if snap.eval_t is not None:
            seen[snap.eval_t] = snap
    return [seen[k] for k in sorted(seen)]
