"""Divergence, rollbacks and stalls as the scheduler decides them, driven directly with heartbeats and a fake clock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport, Hello, Role, ShardAssignment, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.divergence import FLOOR_FRACTION, LOSS_FACTOR, STRIKES, DivergenceWatch, lr_factor
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.outage_clock import ClockReading
from dynabatch.scheduler.saved_progress import load_progress, progress_path, save_progress
from dynabatch.scheduler.stall import STALL_STEPS, StallWatch, stall_limit_s

STEP_S = 0.01


def _hb(prev: WorkerHeartbeat, steps: int = 0, skipped: int = 0, loss: float = 1.0) -> WorkerHeartbeat:
    return WorkerHeartbeat(steps=prev.steps + steps, skipped=prev.skipped + skipped, loss=loss)


def _feed(watch: DivergenceWatch, reports: list[tuple[int, int, float]], settled: bool = True) -> None:
    """Worker w0 reports (new steps, new skipped steps, loss) in turn."""
    prev = WorkerHeartbeat()
    for steps, skipped, loss in reports:
        hb = _hb(prev, steps, skipped, loss)
        watch.worker("w0", prev, hb, settled)
        prev = hb


def test_steps_skipped_in_a_row_are_a_divergence_and_skips_between_good_steps_are_not() -> None:
    watch = DivergenceWatch()
    _feed(watch, [(1, 0, 2.0), (0, 1, math.nan), (1, 0, 1.9), (0, 1, math.nan), (1, 0, 1.8)] * 5)
    assert watch.cause == "" and not watch.suspect
    _feed(watch, [(1, 0, 2.0)] + [(0, 1, math.nan)] * (STRIKES - 1))
    assert watch.cause == "" and watch.suspect, "short of a divergence, but shards should keep their checkpoint"
    _feed(watch, [(1, 0, 2.0)] + [(0, 1, math.nan)] * STRIKES)
    assert "skipped 3 steps in a row" in watch.cause, watch.cause


def test_a_loss_far_above_its_running_level_in_a_row_is_a_divergence_and_a_spike_is_not() -> None:
    watch = DivergenceWatch()
    falling = [(1, 0, 2.0 * 0.97**i) for i in range(100)]
    spike = [(1, 0, 3 * LOSS_FACTOR)]
    _feed(watch, falling + spike + falling[50:] + spike * (STRIKES - 1) + falling[90:])
    assert watch.cause == "", "a loss that comes back down is noise"
    assert watch.loss_limit == pytest.approx(LOSS_FACTOR * max(watch.level, FLOOR_FRACTION * 2.0))
    _feed(watch, falling + spike * STRIKES)
    assert "above" in watch.cause and "3 times in a row" in watch.cause, watch.cause


def test_a_local_round_whose_every_step_was_skipped_is_a_divergence() -> None:
    watch = DivergenceWatch()
    _feed(watch, [(8, 0, 2.0), (8, 8, math.nan)])
    assert "skipped 8 steps" in watch.cause


def test_one_worker_alone_cannot_roll_the_job_back_nor_hold_its_checkpoints() -> None:
    """A diverged model fails every worker; one worker's skips (a bad machine, a lying peer) are not enough, nor
    can its tiny losses pull the job's level down under the honest workers' losses."""
    watch = DivergenceWatch()
    prev = {w: WorkerHeartbeat() for w in ("w0", "w1", "w2")}

    def report(wid: str, steps: int, skipped: int, loss: float) -> None:
        hb = _hb(prev[wid], steps, skipped, loss)
        watch.worker(wid, prev[wid], hb, True)
        prev[wid] = hb

    for _ in range(5):
        report("w0", 1, 0, 1e-9)
        report("w1", 1, 0, 2.0)
        report("w2", 1, 0, 2.1)
    for _ in range(10):
        report("w0", 0, 1, math.nan)
        report("w1", 1, 0, 2.0)
        report("w2", 1, 0, 2.1)
    assert watch.cause == "" and not watch.suspect and watch.level == pytest.approx(2.0)
    report("w1", 0, 1, math.nan)
    assert watch.suspect and watch.cause == "", "two of three uneasy: keep the last checkpoint"
    for _ in range(STRIKES):
        report("w1", 0, 1, math.nan)
    assert "skipped" in watch.cause and "2 of 3 workers alike" in watch.cause, watch.cause


def test_reports_on_a_model_being_thrown_away_count_for_nothing() -> None:
    watch = DivergenceWatch()
    _feed(watch, [(1, 0, 2.0)] + [(0, 1, math.nan)] * 10, settled=False)
    assert watch.cause == ""
    watch.shard(0, ShardHeartbeat(model_problem="parameters not finite"), settled=False)
    assert watch.cause == ""
    watch.shard(0, ShardHeartbeat(model_problem="parameters not finite"), settled=True)
    assert watch.cause == "ps0: parameters not finite"
    watch.rolled_back()
    assert watch.cause == "" and not watch.suspect


def _job(**kw: Any) -> JobState:
    cfg = JobConfig(
        **{"dataset": "synthetic", "model": "mlp", "global_batch": 96, "epochs": 1.0, "liveness_timeout_s": 2.0, **kw}
    )
    state = JobState(cfg, num_shards=1, train_size=100_000, now=0.0)
    ps = state.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1", shard_index=0), 0.0).id
    wid = state.hello(Hello(role=Role.WORKER, instance="w"), 0.0).id
    state.heartbeat(wid, WorkerHeartbeat(standalone_sps=1000.0), 0.0)
    state.shard_heartbeat(ps, ShardHeartbeat(membership=state.roster.membership), 0.0)
    state.shard_heartbeat(
        ps,
        ShardHeartbeat(
            membership=state.roster.membership,  # it applied w0's bound: w0 holds its batch
            batches=state.shard_assignment().batches,
        ),
        0.0,
    )
    return state


def _step(state: JobState, now: float, loss: float = 1.0, skipped: int = 0, rollbacks: int | None = None) -> None:
    """w0 reports one step of its batch (or, with `skipped`, that many steps not pushed), having acted on the
    rollback it was told of (or on `rollbacks`)."""
    m, batch = state.roster.members["w0"], state.allocator.batch_of("w0")
    new = 0 if skipped else 1
    acted = state.assignment_for(m).rollbacks if rollbacks is None else rollbacks
    state.heartbeat(
        "w0",
        WorkerHeartbeat(
            steps=m.steps + new,
            samples=m.samples + batch * new,
            batch=batch,
            times=StepTimes(step_s=STEP_S, compute_s=STEP_S),
            standalone_sps=m.standalone_sps,
            loss=loss,
            skipped=m.last.skipped + skipped,
            rollbacks=acted,
        ),
        now,
    )


def _shard(
    state: JobState, now: float, version: int, good: int, problem: str = "", rollbacks: int | None = None
) -> ShardAssignment:
    known = state.rollbacks.rollback_number if rollbacks is None else rollbacks
    applied = state.shard_assignment().batches
    return state.shard_heartbeat(
        "ps0",
        ShardHeartbeat(
            version=version,
            samples=version * 96,
            membership=state.roster.membership,
            model_problem=problem,
            good_version=good,
            rollbacks=known,
            batches=applied,
        ),
        now,
    )


def test_a_diverged_job_rolls_back_with_half_the_step_size_and_gives_up_after_max_rollbacks() -> None:
    state = _job(max_rollbacks=2)
    for i in range(5):
        _step(state, 0.1 + i * 0.01)
    _shard(state, 0.2, version=5, good=3)
    evaluator = state.hello(Hello(role=Role.EVALUATOR), 0.2).id
    state.eval_report(evaluator, EvalReport(version=5, test_loss=2.3, test_acc=0.1), 0.25)
    worker_scale = state.assignment_for(state.roster.members["w0"]).lr_scale
    told = _shard(state, 0.3, version=6, good=3, problem="parameters not finite", rollbacks=0)
    assert (told.rollbacks, told.lr_factor) == (1, 0.5), "the shard is told to go back, at half the step size"
    assert state.assignment_for(state.roster.members["w0"]).rollbacks == 0, "workers act once the shards have restored"
    assert state.assignment_for(state.roster.members["w0"]).lr_scale == pytest.approx(worker_scale / 2)
    st = state.status(0.3)
    assert [(r.number, r.cause, r.versions, r.lr_factor) for r in st.rollbacks] == [
        (1, "ps0: parameters not finite", {"0": 3}, 0.5)
    ]
    assert st.lr_factor == 0.5 and not st.failed and not st.stopping

    _step(state, 0.31, loss=math.nan, skipped=5)  # computed on the model being thrown away
    _shard(state, 0.32, version=6, good=3, problem="parameters not finite", rollbacks=0)
    assert state.rollbacks.rollback_number == 1, "until the shard applied the rollback, reports are of the old model"
    assert not state.status(0.32).rollbacks[0].done
    _shard(state, 0.4, version=4, good=4)  # restored a checkpoint it wrote since: updates after it count back
    assert state.progress.lost_versions == 2
    assert (st.rollbacks[0].versions, state.status(0.4).rollbacks[0].versions) == ({"0": 3}, {"0": 4})
    assert state.status(0.4).rollbacks[0].done
    assert state.assignment_for(state.roster.members["w0"]).rollbacks == 1
    _step(state, 0.405, loss=math.nan, skipped=STRIKES, rollbacks=0)  # skipped before it dropped the old model
    assert state.rollbacks.rollback_number == 1
    _step(state, 0.41)
    assert state.rollbacks.rollback_number == 1 and not state.rollbacks.divergence.suspect
    state.eval_report(evaluator, EvalReport(version=5, test_loss=2.3, test_acc=0.1), 0.43)  # a late look at v5
    assert state.evaluations.eval is not None and state.evaluations.eval.test_acc == 0.1, (
        "an evaluation of the model thrown away is not the restored one's"
    )
    state.eval_report(evaluator, EvalReport(version=4, test_loss=0.5, test_acc=0.8), 0.44)
    assert state.evaluations.eval is not None and state.evaluations.eval.version == 4, (
        "the restored model's evaluation replaces the diverged one's"
    )
    state.eval_report(evaluator, EvalReport(version=3, test_loss=0.5, test_acc=0.8), 0.45)
    assert state.evaluations.eval is not None and state.evaluations.eval.version == 4, (
        "and older ones are ignored again"
    )

    _shard(state, 0.5, version=4, good=3, problem="parameter norm 1e9 is 1e6x its running level")
    assert state.rollbacks.rollback_number == 2 and state.rollbacks.lr_factor == 0.25
    _shard(state, 0.6, version=3, good=3)
    for i in range(STRIKES):
        _step(state, 0.7 + i * 0.01, loss=math.nan, skipped=1)
    st = state.status(0.8)
    assert "w0 skipped 3 steps" in st.failed and "--max-rollbacks 2" in st.failed, st.failed
    assert len(st.rollbacks) == 2 and st.stopping and not st.finished
    assert state.assignment_for(state.roster.members["w0"]).stop
    state.bye("w0", 0.9)
    assert state.finished, "a failed job ends once its workers left, without waiting for a final evaluation"


def test_shards_keep_their_last_checkpoint_while_the_workers_skip_steps() -> None:
    state = _job()
    _step(state, 0.1)
    assert not _shard(state, 0.2, version=1, good=1).hold_checkpoints
    _step(state, 0.3, loss=math.nan, skipped=1)
    assert _shard(state, 0.4, version=1, good=1).hold_checkpoints
    _step(state, 0.5)
    assert not _shard(state, 0.6, version=2, good=1).hold_checkpoints


def test_a_shard_reporting_impossible_divergence_fields_is_refused() -> None:
    state = _job(max_rollbacks=2)
    for bad in (ShardHeartbeat(rollbacks=3), ShardHeartbeat(good_version=-2), ShardHeartbeat(model_problem="x" * 1000)):
        with pytest.raises(ProtocolError, match="bad_field"):
            state.shard_heartbeat("ps0", bad, 0.1)
    assert state.rollbacks.rollback_number == 0


def test_a_worker_whose_skipped_count_goes_backwards_is_refused() -> None:
    state = _job()
    _step(state, 0.1, loss=math.nan, skipped=2)
    with pytest.raises(ProtocolError, match="skipped went backwards"):
        state.heartbeat("w0", WorkerHeartbeat(standalone_sps=1000.0, skipped=1), 0.2)


def test_rollbacks_and_the_smaller_step_survive_a_scheduler_restart(tmp_path: Path) -> None:
    state = _job()
    _step(state, 0.1)
    _shard(state, 0.2, version=1, good=1, problem="parameters not finite")
    path = progress_path(str(tmp_path), state.job.job)
    save_progress(path, state.saved(1.0, wall=ClockReading(100.0)))
    again = JobState(state.job, num_shards=1, now=0.0)
    saved = load_progress(path, to_dict(state.job))
    assert saved is not None
    again.resume(saved, 0.0, wall=ClockReading(101.0))
    assert again.rollbacks.rollback_number == 1 and again.rollbacks.lr_factor == 0.5
    assert again.status(0.0).rollbacks == state.status(1.0).rollbacks


def test_a_fresh_scheduler_learns_a_later_rollback_from_its_shards() -> None:
    """Without saved progress, a shard that applied rollback 2 must not be ordered to roll back to "1" again."""
    state = _job()
    _shard(state, 0.1, version=1, good=1, rollbacks=2)
    assert state.rollbacks.rollback_number == 2 and state.rollbacks.lr_factor == lr_factor(2)


def test_a_job_that_trains_nothing_for_longer_than_its_steps_allow_fails() -> None:
    state = _job(join_timeout_s=5.0)
    state.tick(0.0)
    assert not state.end.failed, "not training yet"
    _step(state, 1.0)
    state.tick(1.0)
    for i in range(11):  # the worker lives on, and trains nothing
        state.roster.members["w0"].last_seen = 1.0 + i * 0.5
        state.tick(1.0 + i * 0.5)
    assert not state.end.failed, "5 s (the floor: 50 steps of 10 ms are less) have not passed yet"
    state.tick(6.5)
    assert "no sample trained" in state.end.failed and "limit 5 s" in state.end.failed, state.end.failed
    assert state.stopping


def test_the_stall_limit_follows_the_slowest_workers_steps_and_is_never_below_the_floor() -> None:
    assert stall_limit_s([], 120.0) == 120.0
    assert stall_limit_s([0.01, 0.05], 1.0) == pytest.approx(STALL_STEPS * 0.05)
    assert stall_limit_s([0.01, 10.0], 120.0) == pytest.approx(STALL_STEPS * 10.0)
    watch = StallWatch()
    assert watch.observe(10, 0.0, True) == 0.0
    assert watch.observe(10, 3.0, True) == 3.0
    assert watch.observe(11, 4.0, True) == 0.0, "a sample trained resets the clock"
    assert watch.observe(11, 9.0, False) == 0.0, "nor does it run while the job is not training"
