"""summary.json from a timeline of STATUS snapshots: throughput, time to accuracy, staleness."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.cluster.report import (
    Snapshot,
    read_timeline,
    summarize,
    time_to_accuracy,
    time_to_target,
    write_timeline,
)
from dynabatch.common.config import JobConfig
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import (
    DepartedWorker,
    Hello,
    JobStatus,
    Role,
    ShardHeartbeat,
    ShardStatus,
    WorkerHeartbeat,
    WorkerStatus,
)
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.job_state import JobState


def _snap(
    t: float,
    samples: int,
    training_t: float | None,
    stopping: bool = False,
    acc: float | None = None,
    eval_t: float | None = None,
    staleness: list[int] | None = None,
    metrics: dict[str, float] | None = None,
) -> JobStatus:
    worker = WorkerStatus(
        name="worker0",
        batch=64,
        standalone_sps=1000.0,
        samples=samples,
        observed_steps=samples // 64,
        step_s_total=samples / 64 * 0.05,
        observed_samples=samples,
        compute_s_total=samples / 1250,
        data_s_total=samples // 64 * 0.01,
        max_batch=128,
    )
    return JobStatus(
        t=t,
        epoch=samples / 60000,
        samples=samples,
        loss=0.5,
        test_acc=acc,
        test_loss=0.4,
        eval_t=eval_t,
        training_t=training_t,
        stopping=stopping,
        finished=stopping,
        bytes=samples * 100,
        staleness=staleness or [],
        workers={"w0": worker},
        metrics=metrics or {},
    )


def test_throughput_counts_from_the_first_batches_to_the_stop() -> None:
    timeline = [
        _snap(1.0, 0, None),  # registered, probing its speed: not training yet
        _snap(4.0, 0, 0.0),
        _snap(9.0, 4000, 5.0, acc=0.80, eval_t=8.5),
        _snap(14.0, 8000, 10.0, stopping=True, acc=0.86, eval_t=13.0, staleness=[10, 80, 10]),
        _snap(20.0, 8100, 16.0, stopping=True, acc=0.87, eval_t=19.5, staleness=[10, 80, 10]),  # final eval
    ]
    s = summarize(timeline, wall_s=21.0, warmup_fraction=0.0)
    assert s["train_s"] == pytest.approx(10.0)
    assert s["samples_per_s"] == pytest.approx(800.0)
    assert s["fraction_of_standalone"] == pytest.approx(0.8)
    assert s["workers"]["w0"]["compute_samples_per_s"] == pytest.approx(1250.0)
    assert s["workers"]["w0"]["mean_data_s_after_warmup"] == pytest.approx(0.01)
    assert s["workers"]["w0"]["max_batch"] == 128
    assert s["fraction_of_compute_speed"] == pytest.approx(800.0 / 1250.0)
    assert s["time_to_accuracy_s"] == {"0.85": pytest.approx(9.0), "0.88": None}
    assert s["staleness_mean"] == pytest.approx(1.0) and s["staleness_p99"] == 2 and s["updates"] == 100
    assert s["final_test_acc"] == 0.87


def _budgeted(t: float, samples: int, batch: int, unallotted: int | None, stopping: bool = False) -> JobStatus:
    """A snapshot of a job of one epoch of 6,000 samples whose worker holds `batch`."""
    snap = _snap(t, samples, None if unallotted is None else t - 4.0, stopping)
    return replace(
        snap,
        epoch=samples / 6000,
        train_size=6000,
        target_epochs=1.0,
        unallotted=unallotted,
        workers={"w0": replace(snap.workers["w0"], batch=batch)},
    )


def test_the_summary_states_the_epochs_asked_and_trained_and_the_batches_before_the_last_ones() -> None:
    """The last batches are what each worker's allotment leaves, down to 0 while the shards confirm the end: the
    batch the run settled on is the one before its budget was all allotted, and its throughput counts until
    the budget was trained, not until the shards confirmed it."""
    timeline = [
        _budgeted(1.0, 0, 0, None),
        _budgeted(4.0, 0, 64, 6000),
        _budgeted(9.0, 4000, 64, 1000),
        _budgeted(11.0, 5990, 10, 0),
        _budgeted(12.0, 6000, 0, 0),
        _budgeted(14.0, 6000, 0, 0, True),
    ]
    s = summarize(timeline, wall_s=15.0, warmup_fraction=0.0)
    assert s["workers"]["w0"]["final_batch"] == 64
    assert (s["epochs_requested"], s["epochs_trained"], s["overshoot_samples"]) == (1.0, 1.0, 0)
    assert s["train_s"] == pytest.approx(8.0) and s["samples_per_s"] == pytest.approx(750.0)
    whole = [
        _budgeted(1.0, 0, 0, None),
        _budgeted(4.0, 0, 64, 0),
        _budgeted(9.0, 4000, 64, 0),
        _budgeted(12.0, 6000, 0, 0),
        _budgeted(14.0, 6000, 0, 0, True),
    ]
    assert summarize(whole, 15.0, 0.0)["workers"]["w0"]["final_batch"] == 64, "a job allotted whole from its start"
    short = summarize([*timeline[:3], replace(timeline[2], t=10.0, stopping=True, budget_spent=True)], 11.0, 0.0)
    assert short["overshoot_samples"] == -2000, "a job its time budget stopped is short of its epochs"


def test_a_worker_that_left_between_two_snapshots_is_summarised_with_the_totals_it_left_with() -> None:
    """A worker's last step and its BYE can fall between two STATUS snapshots (a local round's report, then its
    allotment trained): the last snapshot holding it shows none of that round, and STATUS keeps what it left with."""
    running = _snap(4.0, 640, 1.0)
    left = replace(_snap(6.0, 1280, 1.0, stopping=True), workers={})
    left.departed = {"w0": DepartedWorker("worker0", steps=20, samples=1280, discarded=2)}
    s = summarize([_snap(1.0, 0, None), running, left], wall_s=7.0, warmup_fraction=0.0)
    assert (s["workers"]["w0"]["samples"], s["workers"]["w0"]["discarded"]) == (1280, 2)
    assert summarize([_snap(1.0, 0, None), running], 5.0, 0.0)["workers"]["w0"]["samples"] == 640


def test_time_to_accuracy_is_none_before_training_starts() -> None:
    assert time_to_accuracy([_snap(1.0, 0, None, acc=0.9, eval_t=1.0)], (0.85,)) == {"0.85": None}


def _metric_timeline() -> list[JobStatus]:
    """Training from t=4; evaluations at 1 (before it), 8.5, 13 and 19.5 s (each repeated by later snapshots)."""
    evals = [
        (8.5, {"loss": 0.9, "top2": 0.7}),
        (13.0, {"loss": 0.4, "top2": 0.95}),
        (19.5, {"loss": 0.25, "top2": float("nan")}),
    ]
    before = {"loss": 2.0, "top2": 0.5}  # the evaluator's first look, at the initial model
    timeline = [_snap(1.0, 0, None, eval_t=1.0, metrics=before), _snap(4.0, 0, 0.0, eval_t=1.0, metrics=before)]
    for i, (eval_t, metrics) in enumerate(evals):
        for t in (eval_t + 0.5, eval_t + 1.5):
            timeline.append(_snap(t, 1000 * (i + 1), t - 4.0, eval_t=eval_t, metrics=metrics))
    return timeline


@pytest.mark.parametrize(
    "target, seconds",
    [
        ("top2>=0.9", 9.0),
        ("top2>=0.99", None),
        ("loss<=0.5", 9.0),
        ("loss<=0.3", 15.5),
        ("loss<=0.1", None),
        ("recall>=0.1", None),
        ("top2>=0.5", 0.0),
    ],
    ids=[
        "higher is better",
        "never met",
        "lower is better",
        "met by the last",
        "never low enough",
        "a metric no evaluation reports",
        "met before the first batches",
    ],
)
def test_time_to_target_counts_from_the_first_batches_to_the_first_evaluation_meeting_it(
    target: str, seconds: float | None
) -> None:
    got = time_to_target(_metric_timeline(), MetricTarget.parse(target))
    assert got == (None if seconds is None else pytest.approx(seconds))


def test_the_summary_names_its_target_and_keeps_the_accuracy_marks() -> None:
    timeline = _metric_timeline()
    s = summarize(timeline, wall_s=22.0, warmup_fraction=0.0, target=MetricTarget.parse("loss <= 0.5"))
    assert s["target_metric"] == "loss<=0.5" and s["time_to_target_s"] == pytest.approx(9.0)
    assert s["time_to_accuracy_s"] == {"0.85": None, "0.88": None}
    untargeted = summarize(timeline, wall_s=22.0, warmup_fraction=0.0)
    assert untargeted["target_metric"] is None and untargeted["time_to_target_s"] is None


# timeline.json's keys as the benchmarks and other tools read them: a change here changes the run folder's format.
TIMELINE_KEYS = {
    "t",
    "job",
    "protocol",
    "batch_policy",
    "epoch",
    "target_epochs",
    "samples",
    "bytes",
    "staleness",
    "training_t",
    "budget_spent",
    "local_steps",
    "local_steps_reason",
    "loss",
    "test_acc",
    "test_loss",
    "metrics",
    "train_size",
    "eval_version",
    "eval_t",
    "eval_model_t",
    "stopping",
    "finished",
    "final_eval",
    "final_eval_given_up",
    "assignment_id",
    "workers",
    "departed",
    "shards",
    "decisions",
    "decision_s",
    "lost_samples",
    "lost_versions",
    "rollbacks",
    "lr_factor",
    "failed",
    "unallotted",
    "auto_policy",
    "auto_reason",
    "auto_protocol",
    "auto_protocol_reason",
    "wall_t",
}
WORKER_KEYS = {
    "role",
    "name",
    "host",
    "metrics_url",
    "joined",
    "steps",
    "samples",
    "batch",
    "times",
    "samples_per_s",
    "standalone_sps",
    "standalone_fixed_s",
    "loss",
    "step_s_total",
    "observed_steps",
    "compute_s_total",
    "observed_samples",
    "version",
    "endpoint",
    "data_s_total",
    "max_batch",
    "slowdown",
    "chunk_group",
    "credit_bytes",
    "wire_reason",
    "serve_rank",
    "idle",
    "discarded",
}


def _scheduler_status() -> JobStatus:
    """A status as the scheduler builds it: a shard, a worker with a step and a decision behind it."""
    state = JobState(
        JobConfig(dataset="synthetic", model="mlp", global_batch=96), num_shards=1, train_size=1000, now=0.0
    )
    shard = state.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1"), 0.0).id
    wid = state.hello(Hello(role=Role.WORKER, name="a", slowdown="2"), 0.0).id
    state.heartbeat(wid, WorkerHeartbeat(standalone_sps=1000.0), 0.0)  # live from its first report
    # every shard holds it: its share,
    state.shard_heartbeat(shard, ShardHeartbeat(membership=state.roster.membership), 0.0)
    state.shard_heartbeat(
        shard,
        ShardHeartbeat(
            membership=state.roster.membership,  # bounded by every shard: it holds it
            batches=state.shard_assignment().batches,
        ),
        0.0,
    )
    state.heartbeat(
        wid, WorkerHeartbeat(steps=1, samples=96, batch=96, times=StepTimes(step_s=0.1, compute_s=0.08), loss=2.0), 0.5
    )
    return state.status(1.0)


def test_timeline_json_keeps_its_keys_and_reads_back(tmp_path: Path) -> None:
    status = _scheduler_status()
    write_timeline(tmp_path, [Snapshot(status, 1.5)])
    (entry,) = json.loads((tmp_path / "timeline.json").read_text())
    assert entry.keys() == TIMELINE_KEYS
    assert entry["wall_t"] == 1.5
    (worker,) = entry["workers"].values()
    assert worker.keys() == WORKER_KEYS and worker["name"] == "a" and worker["batch"] == 96
    assert worker["times"] == {**asdict(StepTimes()), "step_s": 0.1, "compute_s": 0.08}, "one map, every phase named"
    assert worker["slowdown"] == "2x", "STATUS gives the slowdown the worker's HELLO reported"
    assert entry["shards"]["0"] == {
        "endpoint": "tcp://ps:1",
        "version": 0,
        "metrics_url": "",
        "discarded": 0,
        "model_problem": "",
        "good_version": -1,
        "busy_s": 0.0,
        "queued_s": 0.0,
        "busy_sq_s": 0.0,
        "served": 0,
        "transfers": 0.0,
        "pushed": 0,
    }
    assert entry["decisions"][0].keys() == {"t", "reason", "subject", "batches", "predicted_step_s"}
    assert entry["decision_s"] == {"count": 0, "mean": None, "p99": None}
    assert read_timeline(tmp_path / "timeline.json") == [status]
    lines = (tmp_path / "timeline.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert len(header) == len(set(header)), f"a column named twice reads as another in pandas: {header}"
    (row,) = csv.DictReader(lines)
    assert (row["samples"], row["worker_samples"]) == (str(status.samples), str(status.workers["w0"].samples))
    assert (row["worker"], row["batch"], row["step_s"], row["compute_s"], row["wait_s"]) == (
        "w0",
        "96",
        "0.1",
        "0.08",
        "0.0",
    )


def test_a_timeline_that_is_not_a_status_is_refused_with_the_field(tmp_path: Path) -> None:
    entry = Snapshot(_scheduler_status(), 1.5).to_json()
    next(iter(entry["workers"].values()))["batch"] = "many"
    (tmp_path / "timeline.json").write_text(json.dumps([entry]))
    with pytest.raises(ProtocolError, match=r"timeline.json\[0\].workers.w0.batch must be int"):
        read_timeline(tmp_path / "timeline.json")


def test_a_timeline_from_before_the_nested_step_times_is_refused_not_read_as_zero_times(tmp_path: Path) -> None:
    entry = Snapshot(_scheduler_status(), 1.5).to_json()
    worker = next(iter(entry["workers"].values()))
    worker.update(worker.pop("times"))  # protocol 3's STATUS: step_s, compute_s, ... beside the other fields
    (tmp_path / "timeline.json").write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match="before protocol 4"):
        read_timeline(tmp_path / "timeline.json")


def test_discarded_pushes_count_each_shards_highest_report_after_the_shards_left() -> None:
    """Shards leave STATUS at the end of a job, and a restarted shard counts afresh from 0."""

    def with_shards(t: float, **discarded: int) -> JobStatus:
        snap = _snap(t, 640 * int(t + 1), training_t=t)
        snap.shards = {slot.lstrip("s"): ShardStatus("tcp://ps", 1, "", n) for slot, n in discarded.items()}
        return snap

    timeline = [
        with_shards(0.0, s0=0, s1=0),
        with_shards(1.0, s0=5, s1=2),
        with_shards(2.0, s0=1, s1=3),
        with_shards(3.0),
    ]
    assert summarize(timeline, wall_s=4.0, warmup_fraction=0.0)["discarded"] == 5 + 3
