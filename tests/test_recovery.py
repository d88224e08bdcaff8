"""Recovery's logic without processes: lost work from shard reports, the scheduler's saved progress."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.verified_files import write_verified
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport, Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.lost_work import LostWork, ShardMark, lost_work
from dynabatch.scheduler.outage_clock import MAX_UNTIMED_OUTAGE_S, ClockReading, outage_s
from dynabatch.scheduler.saved_progress import load_progress, progress_path, save_progress


def _job(**kw: Any) -> JobConfig:
    return JobConfig(
        **{"dataset": "synthetic", "model": "mlp", "global_batch": 96, "epochs": 1.0, "liveness_timeout_s": 2.0, **kw}
    )


def _running(job: JobConfig, now: float = 0.0) -> tuple[JobState, str, str]:
    """A job with one shard and one worker holding the whole batch."""
    state = JobState(job, num_shards=1, train_size=1000, now=now)
    ps = state.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1", shard_index=0), now).id
    wid = state.hello(Hello(role=Role.WORKER, instance="w-a"), now).id
    state.heartbeat(wid, WorkerHeartbeat(standalone_sps=1000.0), now)
    state.shard_heartbeat(ps, ShardHeartbeat(membership=state.roster.membership), now)
    return state, ps, wid


def _steps(state: JobState, wid: str, n: int, now: float) -> None:
    m, batch = state.roster.members[wid], state.allocator.allocation.get(wid, 0)
    for i in range(n):
        state.heartbeat(
            wid,
            WorkerHeartbeat(
                steps=m.steps + 1,
                samples=m.samples + batch,
                batch=batch,
                times=StepTimes(step_s=0.01, compute_s=0.01),
                standalone_sps=m.standalone_sps,
                loss=1.0,
            ),
            now + i * 0.01,
        )


def test_lost_work_is_the_drop_in_version_and_samples_and_never_more_than_was_trained() -> None:
    assert lost_work(0, ShardMark(10, 960), 10, 960, 5000) is None
    assert lost_work(0, ShardMark(10, 960), 12, 1100, 5000) is None, "a shard moving on lost nothing"
    assert lost_work(1, ShardMark(10, 960), 4, 384, 5000) == LostWork(1, 6, 576)
    assert lost_work(0, ShardMark(10, 960), 0, 0, 500) == LostWork(0, 10, 500), "capped at what can be counted back"


def test_a_shard_that_comes_back_behind_has_its_lost_samples_trained_again() -> None:
    state, ps, wid = _running(_job(epochs=1.0))
    _steps(state, wid, 5, 0.1)  # 480 samples
    state.shard_heartbeat(ps, ShardHeartbeat(version=5, samples=480, membership=state.roster.membership), 0.2)
    assert state.progress.epoch == pytest.approx(0.48)
    state.shard_heartbeat(ps, ShardHeartbeat(version=2, samples=192, membership=state.roster.membership), 0.3)
    assert (state.progress.lost_versions, state.progress.lost_samples) == (3, 288)
    assert [(lost.shard, lost.versions, lost.samples) for lost in state.progress.losses] == [(0, 3, 288)]
    assert state.progress.samples == 480
    assert state.progress.epoch == pytest.approx(0.192), "the epoch counts what the model holds"
    _steps(state, wid, 8, 0.4)  # 1248 trained, 960 held: not yet the job's one epoch
    assert not state.stopping
    _steps(state, wid, 1, 0.6)
    for t in (0.61, 0.62):  # the shard reports on the model that holds the job's epoch
        assert not state.stopping
        state.shard_heartbeat(ps, ShardHeartbeat(version=15, samples=1056, membership=state.roster.membership), t)
    assert state.stopping
    st = state.status(0.7)
    assert (st.lost_samples, st.lost_versions, st.samples) == (288, 3, 1344)


def test_a_shard_reporting_a_negative_count_is_refused() -> None:
    state, ps, _ = _running(_job())
    with pytest.raises(ProtocolError, match="HEARTBEAT.samples"):
        state.shard_heartbeat(ps, ShardHeartbeat(samples=-1), 0.1)
    assert state.progress.lost_samples == 0


def test_a_resumed_job_keeps_its_samples_evaluation_ids_speed_models_and_shard_marks(tmp_path: Path) -> None:
    job = _job(epochs=2.0)
    state, ps, wid = _running(job)
    _steps(state, wid, 6, 0.1)
    state.shard_heartbeat(ps, ShardHeartbeat(version=6, samples=576, membership=state.roster.membership), 0.2)
    evaluator = state.hello(Hello(role=Role.EVALUATOR, instance="e"), 0.2).id
    state.eval_report(evaluator, EvalReport(version=6, test_loss=0.5, test_acc=0.8), 0.3)
    path = progress_path(str(tmp_path), job.job)
    save_progress(path, state.saved(10.0, wall=ClockReading(5000.0)))
    assert not list(tmp_path.glob(".*tmp")), "no temporary file is left behind"

    again = JobState(job, num_shards=1, now=100.0)
    saved = load_progress(path, to_dict(job))
    assert saved is not None
    again.resume(saved, 100.0, wall=ClockReading(5003.0))
    progress = again.progress
    assert (progress.samples, progress.train_size) == (576, 1000) and progress.epoch == pytest.approx(0.576)
    kept = again.evaluations.eval
    assert kept is not None and kept.test_acc == 0.8 and again.status(100.0).t == pytest.approx(13.0), (
        "the outage counts"
    )
    ps_again = again.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1", shard_index=0), 100.0).id
    again.shard_heartbeat(ps_again, ShardHeartbeat(version=6, samples=576), 100.1)
    assert again.progress.lost_samples == 0, "a shard that kept its state lost nothing"
    rejoined = again.hello(Hello(role=Role.WORKER, instance="w-a"), 100.2).id
    assert rejoined not in (wid, evaluator) and rejoined == "w1", "ids go on from the saved counter"
    again.heartbeat(rejoined, WorkerHeartbeat(standalone_sps=1000.0), 100.3)
    assert again.allocator.speeds[rejoined].window() == state.allocator.speeds[wid].window()
    _steps(again, rejoined, 1, 100.4)
    new = again.allocator.allocation.get(rejoined, 0)
    assert again.progress.samples == 576 + new, "the rejoined worker counts only its new samples"
    again.shard_heartbeat(ps_again, ShardHeartbeat(version=2, samples=192), 100.5)
    assert again.progress.lost_samples == 384, "a restart while the scheduler was down is still caught"


def test_saved_progress_of_another_job_is_an_error_and_a_damaged_copy_falls_back_to_the_previous(
    tmp_path: Path,
) -> None:
    job = _job()
    path = progress_path(str(tmp_path), job.job)
    assert load_progress(path, to_dict(job)) is None
    state, ps, wid = _running(job)
    save_progress(path, state.saved(1.0, wall=ClockReading(0.0)))
    with pytest.raises(ValueError, match="epochs=1.0 \\(now 3.0\\)"):
        load_progress(path, to_dict(_job(epochs=3.0)))
    _steps(state, wid, 3, 0.1)
    save_progress(path, state.saved(2.0, wall=ClockReading(0.0)))
    saved = load_progress(path, to_dict(job))
    assert saved is not None and saved.samples == 288
    header, _, payload = path.read_bytes().partition(b"\n")
    data = json.loads(payload)
    path.write_bytes(header + b"\n" + json.dumps({**data, "samples": data["samples"] * 10}).encode())
    saved = load_progress(path, to_dict(job))
    assert saved is not None and saved.samples == 0, "an edited copy fails its checksum: the previous is read"
    path.write_bytes(path.read_bytes()[:40])
    saved = load_progress(path, to_dict(job))
    assert saved is not None and saved.samples == 0, "so is a truncated one"
    previous = path.with_name(path.name + ".prev")
    header, _, payload = previous.read_bytes().partition(b"\n")
    previous.write_bytes(header + b"\n" + payload.replace(b'"t": 1.0', b'"t": NaN'))
    with pytest.raises(ValueError, match="remove"):
        load_progress(path, to_dict(job))
    assert math.isnan(JobState(job, 1).progress.loss), "nothing was resumed"


def test_a_copy_with_a_good_checksum_but_impossible_figures_is_refused(tmp_path: Path) -> None:
    job = _job()
    path = progress_path(str(tmp_path), job.job)
    state, _, _ = _running(job)
    for t in (1.0, 2.0):
        save_progress(path, state.saved(t, wall=ClockReading(0.0)))
    data = json.loads(path.read_bytes().partition(b"\n")[2])
    for bad in ({"samples": -5}, {"t": float("inf")}, {"training_s": -1.0}):
        save_progress(path, state.saved(1.0, wall=ClockReading(0.0)))  # the previous copy is good
        write_verified(path, json.dumps({**data, **bad}).encode())
        saved = load_progress(path, to_dict(job))
        assert saved is not None and saved.t == 1.0, bad


def test_an_outage_is_timed_by_the_boot_clock_on_the_same_boot_and_a_wall_clock_jump_is_bounded() -> None:
    saved = ClockReading(1000.0, "boot-a", 50.0)
    assert outage_s(saved, ClockReading(1000.0 + 1e6, "boot-a", 53.0)) == 3.0, "the wall clock jumped; boot did not"
    assert outage_s(saved, ClockReading(1003.0, "boot-b", 1.0)) == 3.0, "another machine: the wall clock"
    assert outage_s(saved, ClockReading(1000.0 + 1e6, "boot-b", 1.0)) == MAX_UNTIMED_OUTAGE_S
    assert outage_s(saved, ClockReading(0.0)) == 0.0, "a clock set back counts no outage"


def test_a_budget_is_not_spent_by_a_clock_jump_across_a_restart(tmp_path: Path) -> None:
    job = _job(epochs=100.0, time_budget_s=3600.0)
    state, _, _ = _running(job)
    path = progress_path(str(tmp_path), job.job)
    save_progress(path, state.saved(10.0, wall=ClockReading(1000.0)))
    again = JobState(job, num_shards=1, now=0.0)
    saved = load_progress(path, to_dict(job))
    assert saved is not None
    again.resume(saved, 0.0, wall=ClockReading(1000.0 + 1e6))
    again.tick(0.0)
    assert not again.end.budget_spent and again.status(0.0).t == pytest.approx(10.0 + MAX_UNTIMED_OUTAGE_S)


def test_resumed_samples_beyond_what_the_shards_hold_are_cut_back(tmp_path: Path) -> None:
    job = _job(epochs=100.0)
    state, ps, wid = _running(job)
    _steps(state, wid, 5, 0.1)  # 480 samples
    saved = state.saved(1.0, wall=ClockReading(0.0))
    saved.samples *= 10  # an edited file whose checksum was made again
    again = JobState(job, num_shards=1, now=0.0)
    again.resume(saved, 0.0, wall=ClockReading(0.0))
    assert again.progress.samples == 4800
    ps_again = again.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1", shard_index=0), 0.1).id
    again.shard_heartbeat(ps_again, ShardHeartbeat(version=5, samples=480), 0.2)
    assert again.progress.samples == 480 + job.global_batch, "the shard's count (and one batch in flight) bounds it"
