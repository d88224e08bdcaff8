"""The scheduler's decisions, driven directly with messages and a fake clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport, Hello, Role, ShardHeartbeat, WorkerAssignment, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.progress_watch import evaluation_allowed_s, progress_allowed_s


def _job(**kw: Any) -> JobState:
    cfg = JobConfig(
        **{
            "dataset": "synthetic",
            "model": "mlp",
            "global_batch": 96,
            "epochs": 1.0,
            "liveness_timeout_s": 2.0,
            "batch_policy": "dynamic",
            **kw,
        }
    )  # the allocation is what is tested
    state = JobState(cfg, num_shards=1, train_size=1000, now=0.0)
    state.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1"), 0.0)
    return state


def _shards_apply(state: JobState, now: float) -> None:
    """Every shard heartbeats having applied its current assignment: the live worker set and the push bounds."""
    for shard in list(state.roster.shards.values()):
        answer = state.shard_assignment()
        state.shard_heartbeat(shard.id, ShardHeartbeat(membership=answer.membership, batches=answer.batches), now)


def _join(state: JobState, sps: float, now: float = 0.0, max_batch: int = 0) -> str:
    wid = state.hello(Hello(role=Role.WORKER, max_batch=max_batch), now).id
    state.heartbeat(wid, WorkerHeartbeat(standalone_sps=sps), now)  # its first report makes it live
    _shards_apply(state, now)  # once every shard holds it, it gets its share,
    _shards_apply(state, now)  # which it holds once every shard reports the bound that lets it push that share
    return wid


def _step(
    state: JobState, wid: str, step_s: float, now: float, loss: float = 1.0, compute_s: float | None = None
) -> WorkerAssignment:
    # a dropped worker reports its last step's batch; a step is all compute unless told otherwise
    m, batch = state.roster.members[wid], state.allocator.allocation.get(wid, 1)
    hb = WorkerHeartbeat(
        steps=m.steps + 1,
        samples=m.samples + batch,
        batch=batch,
        times=StepTimes(step_s=step_s, compute_s=step_s if compute_s is None else compute_s),
        standalone_sps=m.standalone_sps,
        loss=loss,
        assignment_id=state.allocator.assignment_id,
    )
    return state.heartbeat(wid, hb, now)


def test_workers_wait_for_every_shard() -> None:
    state = JobState(JobConfig(dataset="synthetic"), num_shards=2, train_size=1000, now=0.0)
    state.hello(Hello(role=Role.SHARD, endpoint="tcp://a:1"), 0.0)
    with pytest.raises(ProtocolError, match="not_ready"):
        state.hello(Hello(role=Role.WORKER), 0.0)
    state.hello(Hello(role=Role.SHARD, endpoint="tcp://b:1"), 0.0)
    welcome = state.hello(Hello(role=Role.WORKER), 0.0)
    assert welcome.shards == ["tcp://a:1", "tcp://b:1"]
    with pytest.raises(ProtocolError, match="no_slot"):
        state.hello(Hello(role=Role.SHARD), 0.0)


def test_a_new_worker_gets_its_first_batch_only_once_every_shard_knows_it() -> None:
    """Else a shard could close an ssgd round without a worker whose push is on its way."""
    state = JobState(JobConfig(dataset="synthetic", global_batch=96), num_shards=2, train_size=1000, now=0.0)
    ps0 = state.hello(Hello(role=Role.SHARD, endpoint="tcp://a:1"), 0.0).id
    ps1 = state.hello(Hello(role=Role.SHARD, endpoint="tcp://b:1"), 0.0).id
    a = state.hello(Hello(role=Role.WORKER), 0.0).id
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), 0.1)
    assert state.allocator.allocation == {} and state.assignment_for(state.roster.members[a]).batch == 0
    told = state.shard_heartbeat(ps0, ShardHeartbeat(), 0.2)
    assert told.live_workers == [a] and told.membership == state.roster.membership
    state.shard_heartbeat(ps0, ShardHeartbeat(membership=told.membership), 0.3)
    assert state.allocator.allocation == {}, "shard 1 has not applied it yet"
    state.shard_heartbeat(ps1, ShardHeartbeat(membership=told.membership), 0.4)
    assert state.allocator.allocation == {a: 96}, "the shard's heartbeat hands out the batch"
    assert state.allocator.decisions[-1].reason == "joined" and state.allocator.decisions[-1].subject == a

    b = state.hello(Hello(role=Role.WORKER), 0.5).id
    state.heartbeat(b, WorkerHeartbeat(standalone_sps=1000.0), 0.6)
    assert state.allocator.allocation == {a: 96}, "the running worker keeps its batch while b waits"
    with pytest.raises(ProtocolError, match="slot_taken"):
        state.hello(Hello(role=Role.SHARD, endpoint="tcp://b:2", shard_index=1), 0.65)
    state.bye(ps1, 0.66)  # the old shard is gone: its slot is free for the restarted one
    restarted = state.hello(Hello(role=Role.SHARD, endpoint="tcp://b:2", shard_index=1), 0.7).id
    state.shard_heartbeat(restarted, ShardHeartbeat(), 0.8)
    state.shard_heartbeat(ps0, ShardHeartbeat(membership=state.roster.membership), 0.9)
    assert state.allocator.allocation == {a: 96}, "a restarted shard that has applied nothing yet holds back only b"
    state.shard_heartbeat(restarted, ShardHeartbeat(membership=state.roster.membership), 1.0)
    assert set(state.allocator.allocation) == {a, b} and sum(state.allocator.allocation.values()) == 96


def test_a_repeated_hello_of_one_process_registers_it_once() -> None:
    """HELLOs queue in ZeroMQ while the scheduler is down, and arrive together when it comes up."""
    state = _job()
    first = state.hello(Hello(role=Role.WORKER, name="a", instance="abc"), 0.0)
    again = state.hello(Hello(role=Role.WORKER, name="a", instance="abc"), 0.1)
    assert again.id == first.id and [m.id for m in state.roster.members.values() if m.role == "worker"] == [first.id]
    assert state.roster.live_workers == [], "registered but silent: not counted in n"
    state.heartbeat(first.id, WorkerHeartbeat(standalone_sps=100.0), 0.15)
    assert state.roster.live_workers == [first.id]
    membership = state.roster.membership
    other = state.hello(Hello(role=Role.WORKER, name="b", instance="xyz"), 0.2)
    assert other.id != first.id and state.roster.membership == membership, "a worker joins the live set when it reports"
    state.bye(first.id, 0.3)
    rejoined = state.hello(Hello(role=Role.WORKER, name="a", instance="abc"), 0.4)
    assert rejoined.id not in (first.id, other.id), "a member that left registers anew"
    assert state.hello(Hello(role=Role.WORKER), 0.5).id != state.hello(Hello(role=Role.WORKER), 0.5).id, (
        "without an instance every HELLO is a new process"
    )
    with pytest.raises(ProtocolError, match="bad_field"):
        state.hello(Hello(role=Role.WORKER, instance="x" * 65), 0.6)


def test_first_split_follows_standalone_speed_then_measured_step_times() -> None:
    state = _job()
    fast, slow = _join(state, 3000.0), _join(state, 1000.0)
    assert state.allocator.allocation == {fast: 72, slow: 24}
    a = state.assignment_for(state.roster.members[fast])
    assert a.batch == 72 and a.lr_scale == 1.0  # the capped DBS weight: min(1, 72 * 2 / 96)
    assert state.assignment_for(state.roster.members[slow]).lr_scale == pytest.approx(24 * 2 / 96)
    for t in range(1, 30):
        _step(state, fast, 0.010 + 72 * 0.0002 * 2, t * 0.1)  # fast got slower: 2x per sample
        _step(state, slow, 0.010 + 24 * 0.0010, t * 0.1)
    assert sum(state.allocator.allocation.values()) == 96
    assert state.allocator.allocation[fast] < 72
    assert any(d.reason == "speed update" for d in state.allocator.decisions)


def test_hysteresis_keeps_the_split_when_speeds_barely_move() -> None:
    state = _job(reassign_threshold=0.2)
    a, b = _join(state, 1000.0), _join(state, 1000.0)
    before = state.allocator.assignment_id
    for t in range(1, 20):
        _step(state, a, 0.050, t * 0.1)
        _step(state, b, 0.052, t * 0.1)
    assert state.allocator.assignment_id == before


def test_silent_workers_are_dropped_and_their_share_moves() -> None:
    state = _job()
    a, b = _join(state, 1000.0), _join(state, 1000.0)
    _step(state, a, 0.05, 1.0)
    _step(state, b, 0.05, 1.0)
    _step(state, a, 0.05, 2.5)
    _shards_apply(state, 2.5)
    assert state.expire(3.5) == [b]
    assert state.allocator.allocation == {a: 96}
    assert state.allocator.decisions[-1].reason == "heartbeat timeout" and state.allocator.decisions[-1].subject == b
    with pytest.raises(ProtocolError, match="unknown_sender"):
        _step(state, b, 0.05, 4.0)


def test_a_ghost_expires_after_the_liveness_timeout_and_a_loading_worker_is_alive_but_not_in_n() -> None:
    """Workers heartbeat from their WELCOME on (worker/pulse.py): silence from the start is a ghost, while
    heartbeats without a measured speed keep a loading worker alive without making rounds wait for it."""
    state = _job(join_timeout_s=60.0)  # liveness 2 s
    ghost = state.hello(Hello(role=Role.WORKER), 0.0).id
    silent_evaluator = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    loading = state.hello(Hello(role=Role.WORKER), 0.0).id
    membership = state.roster.membership
    for t in range(1, 31):
        state.heartbeat(loading, WorkerHeartbeat(), float(t))
        expired = state.expire(float(t))
        assert expired == ([] if t < 3 else [ghost, silent_evaluator] if t == 3 else []), (t, expired)
        assert state.roster.live_workers == [] and state.roster.membership == membership
        assert state.allocator.allocation == {}
    state.heartbeat(loading, WorkerHeartbeat(standalone_sps=100.0), 31.0)
    assert state.roster.live_workers == [loading], "ready: it is counted in n"
    assert state.roster.membership == membership + 1
    assert loading not in state.expire(32.9) and loading in state.expire(33.1)


def test_a_shard_restoring_its_checkpoint_before_its_first_heartbeat_gets_the_join_timeout() -> None:
    state = JobState(
        JobConfig(dataset="synthetic", liveness_timeout_s=2.0, join_timeout_s=60.0),
        num_shards=1,
        train_size=1000,
        now=0.0,
    )
    shard = state.hello(Hello(role=Role.SHARD, endpoint="tcp://ps:1"), 0.0).id
    assert state.expire(59.0) == [] and state.expire(61.0) == [shard]


def test_epochs_count_samples_of_departed_workers_and_the_job_ends_after_the_final_eval() -> None:
    state = _job()
    ev = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    a, b = _join(state, 1000.0), _join(state, 1000.0)
    t = 0.0
    while not state.stopping:
        t += 0.1
        for w in (a, b):
            if w in state.roster.live_workers:
                _step(state, w, 0.05, t)
        if t > 0.5 and b in state.roster.live_workers:
            state.bye(b, t)
        _shards_apply(state, t)
    assert state.progress.samples >= 1000 and state.progress.epoch >= 1.0
    assert state.assignment_for(state.roster.members[a]).stop
    assert not state.assignment_for(state.roster.members[ev]).stop, "the evaluator waits until workers are gone"
    state.bye(a, t)
    assert state.assignment_for(state.roster.members[ev]).stop and not state.finished
    state.eval_report(ev, EvalReport(version=7, test_loss=0.3, test_acc=0.9, final=True), t)
    assert state.finished
    assert state.shard_assignment().stop
    with pytest.raises(ProtocolError, match="job_over"):
        state.hello(Hello(role=Role.WORKER), t)


def test_a_workers_assignment_carries_the_jobs_progress_as_the_shards_do() -> None:
    """A delta protocol's inner steps follow the task's schedule at it (worker/local_steps.py `inner_scale`)."""
    state = _job(epochs=2.0)
    wid = _join(state, 1000.0)
    assert state.assignment_for(state.roster.members[wid]).progress == 0.0
    t, progress = 0.0, [0.0]
    while not state.stopping:
        t += 0.1
        answer = _step(state, wid, 0.05, t)
        _shards_apply(state, t)
        assert answer.progress == state.shard_assignment().progress == min(1.0, state.progress.epoch / 2.0)
        progress.append(answer.progress)
    assert progress == sorted(progress) and progress[-1] == 1.0 and 0.4 < progress[len(progress) // 2] < 0.6


def _run_to_target(state: JobState, wid: str, t: float = 0.0) -> float:
    while not state.stopping:
        t += 0.1
        _step(state, wid, 0.05, t)
        _shards_apply(state, t)
    assert state.bye(wid, t)
    return t


def test_a_job_awaiting_its_final_evaluation_admits_a_late_evaluator_and_waits_for_its_report() -> None:
    state = _job(await_final_eval=True, join_timeout_s=30.0)
    t = _run_to_target(state, _join(state, 1000.0))
    state.tick(t + 5.0)
    assert not state.finished, "no evaluator has joined yet: the final model is not evaluated"
    with pytest.raises(ProtocolError, match="job_over"):
        state.hello(Hello(role=Role.WORKER), t + 5.0)
    ev = state.hello(Hello(role=Role.EVALUATOR), t + 6.0).id
    assert state.assignment_for(state.roster.members[ev]).stop, "it evaluates the final model at once"
    state.eval_report(ev, EvalReport(version=9, test_loss=0.3, test_acc=0.9, final=True), t + 7.0)
    assert state.finished and state.evaluations.final_eval
    with pytest.raises(ProtocolError, match="job_over"):
        state.hello(Hello(role=Role.EVALUATOR), t + 8.0)


def test_a_job_awaiting_its_final_evaluation_gives_up_after_the_join_timeout() -> None:
    state = _job(await_final_eval=True, join_timeout_s=30.0)
    t = _run_to_target(state, _join(state, 1000.0))
    assert state.tick(t) is False
    assert not state.tick(t + 29.0) and not state.finished
    assert state.tick(t + 31.0) is True and state.finished and not state.evaluations.final_eval
    assert state.tick(t + 32.0) is False, "the give-up is reported once"


def test_without_await_final_eval_a_job_with_no_evaluator_finishes_when_workers_are_gone() -> None:
    state = _job()
    _run_to_target(state, _join(state, 1000.0))
    assert state.finished and not state.evaluations.final_eval


def test_a_repeated_bye_is_acknowledged_without_dropping_the_member_twice() -> None:
    state = _job()
    a, b = _join(state, 1000.0), _join(state, 1000.0)
    _step(state, a, 0.05, 1.0)
    samples = state.progress.samples
    assert state.bye(a, 2.0) is True
    assert state.bye(a, 2.5) is False
    assert state.progress.samples == samples and state.roster.live_workers == [b]
    with pytest.raises(ProtocolError, match="unknown_sender"):
        state.bye("w99", 3.0)


def test_ssgd_ends_by_the_samples_its_rounds_trained_not_by_their_number() -> None:
    """Dynamic batches (LB-BSP) make rounds of fewer than B samples: the shards' versions reaching epochs x N / B
    rounds do not end the job; its samples reaching the epochs do."""
    state = _job(protocol="ssgd")  # 1000 samples, B = 96: 11 rounds of B
    wid = _join(state, 1000.0)
    for t in range(1, 11):
        _step(state, wid, 0.05, t)
    for at in (11.0, 11.1, 11.2):
        state.shard_heartbeat(
            state.roster.shards[0].id, ShardHeartbeat(version=11, membership=state.roster.membership), at
        )
    assert state.progress.samples == 960 and not state.stopping
    last = state.assignment_for(state.roster.members[wid])
    assert last.batch == 40 and last.allotted == 1000, "its last batch is what is left"
    m = state.roster.members[wid]
    state.heartbeat(wid, replace(m.last, steps=m.steps + 1, samples=m.samples + 40, batch=40), 12.0)
    assert state.progress.samples == 1000 and state.assignment_for(m).batch == 0
    assert state.shard_assignment().idle_workers == [wid], "no round waits for it"
    for beat in (12.1, 12.2):
        state.shard_heartbeat(
            state.roster.shards[0].id, ShardHeartbeat(version=12, membership=state.roster.membership), beat
        )
    assert state.stopping
    state.bye(wid, 12.5)
    assert state.finished


def test_backwards_or_non_finite_heartbeats_change_nothing() -> None:
    state = _job()
    a = _join(state, 1000.0)
    _step(state, a, 0.05, 1.0)
    before = (state.roster.members[a].steps, state.roster.members[a].samples, state.roster.members[a].last_seen)
    for hb in (
        WorkerHeartbeat(steps=0, samples=0),
        WorkerHeartbeat(steps=5, samples=500, times=StepTimes(step_s=float("inf"))),
        WorkerHeartbeat(steps=5, samples=500, standalone_sps=-1.0),
    ):
        with pytest.raises(ProtocolError, match="bad_field"):
            state.heartbeat(a, hb, 2.0)
    assert (state.roster.members[a].steps, state.roster.members[a].samples, state.roster.members[a].last_seen) == before


def test_the_time_budget_stops_the_job_counted_from_the_first_batches() -> None:
    state = _job(epochs=100.0, time_budget_s=5.0)
    state.heartbeat(state.hello(Hello(role=Role.WORKER), 0.0).id, WorkerHeartbeat(), 0.0)
    assert not state.stopping  # no batches handed out yet: the clock has not started
    wid = _join(state, 1000.0, now=2.0)
    assert state.status(2.0).training_t == 0.0
    _step(state, wid, 0.1, 6.9)
    assert not state.stopping
    assert state.assignment_for(state.roster.members[wid]).stop is False
    _step(state, wid, 0.1, 7.0)
    assert state.stopping and state.status(7.0).budget_spent
    assert state.assignment_for(state.roster.members[wid]).stop is True


def test_staleness_counts_sum_over_workers_including_departed_ones() -> None:
    state = _job()
    a, b = _join(state, 1000.0), _join(state, 1000.0)
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0, steps=4, staleness=[3, 1]), 0.1)
    state.heartbeat(b, WorkerHeartbeat(standalone_sps=1000.0, steps=7, staleness=[0, 2, 5]), 0.1)
    assert state.status(0.1).staleness == [3, 3, 5]
    state.bye(b, 0.2)
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0, steps=5, staleness=[4, 1]), 0.3)
    assert state.status(0.3).staleness == [4, 3, 5]


def test_bad_staleness_counts_are_refused_and_change_nothing() -> None:
    state = _job()
    wid = _join(state, 1000.0)
    for counts in ([-1], [0] * 65):
        with pytest.raises(ProtocolError, match="bad_field"):
            state.heartbeat(wid, WorkerHeartbeat(standalone_sps=1000.0, staleness=counts), 0.1)
    assert state.status(0.1).staleness == []


def test_time_spent_waiting_for_a_round_is_not_taken_for_slowness() -> None:
    """ssgd: everyone's step lasts as long as the slowest's; only the own part tells speeds apart."""
    state = _job(protocol="ssgd", reassign_threshold=0.0)
    fast, slow = _join(state, 1000.0), _join(state, 1000.0)
    assert state.allocator.allocation == {fast: 48, slow: 48}
    per_sample = {fast: 0.0002, slow: 0.0008}
    for t in range(1, 40):
        own = {wid: 0.010 + state.allocator.allocation[wid] * per_sample[wid] for wid in (fast, slow)}
        round_s = max(own.values())  # the round closes when the last worker has pushed
        for wid in (fast, slow):
            m = state.roster.members[wid]
            batch = state.allocator.allocation[wid]
            hb = WorkerHeartbeat(
                steps=m.steps + 1,
                samples=m.samples + batch,
                batch=batch,
                times=StepTimes(step_s=round_s, compute_s=own[wid], wait_s=round_s - own[wid]),
                standalone_sps=1000.0,
                loss=1.0,
            )
            state.heartbeat(wid, hb, t * 0.1)
    assert state.allocator.allocation[fast] > 3 * state.allocator.allocation[slow]


def test_a_worker_whose_steps_outlast_the_liveness_timeout_is_not_dropped_for_being_slow() -> None:
    """Liveness 2 s, but this worker's steps take 1.5 s: three steps (4.5 s) of silence are allowed."""
    state = _job()
    slow, fast = _join(state, 100.0), _join(state, 100.0)
    _step(state, slow, 1.5, now=1.0)
    _step(state, fast, 0.1, now=1.0)
    for now in (2.0, 3.5, 5.0):
        _shards_apply(state, now)  # the shard stays live; only the workers fall silent
        state.expire(now)
    assert fast not in state.roster.live_workers, "a fast worker silent for over 2 s is gone"
    assert slow in state.roster.live_workers, "4 s of silence is under three of its 1.5 s steps"
    _shards_apply(state, 5.6)
    assert state.expire(5.6) == [slow]


@pytest.mark.parametrize(
    "report, field",
    [
        (
            EvalReport(version=1, test_loss=0.5, test_acc=0.9, metrics={f"m{i}": 0.5 for i in range(33)}),
            "EVAL.metrics: 33",
        ),
        (EvalReport(version=1, test_loss=0.5, test_acc=0.9, metrics={"": 0.5}), "EVAL.metrics: metric name ''"),
        (EvalReport(version=1, test_loss=0.5, test_acc=0.9, metrics={"x" * 65: 0.5}), "EVAL.metrics: metric name"),
        (EvalReport(version=1, test_loss=0.5, test_acc=0.9, metrics={"bad\nname": 0.5}), "must be printable"),
        (EvalReport(version=1, test_loss=0.5, test_acc=0.9, metrics={"loss": float("inf")}), "EVAL.metrics['loss']"),
        (EvalReport(version=1, test_loss=float("-inf"), test_acc=0.9), "EVAL.test_loss"),
        (EvalReport(version=1, test_loss=0.5, test_acc=float("inf")), "EVAL.test_acc"),
        (EvalReport(version=-1, test_loss=0.5, test_acc=0.9), "EVAL.version"),
    ],
    ids=[
        "too many names",
        "empty name",
        "long name",
        "unprintable name",
        "infinite metric",
        "infinite test loss",
        "infinite test accuracy",
        "negative version",
    ],
)
def test_an_evaluation_out_of_bounds_is_refused_naming_the_field_and_changes_nothing(
    report: EvalReport, field: str
) -> None:
    state = _job()
    ev = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    good = EvalReport(version=0, test_loss=0.7, test_acc=0.8, metrics={"loss": 0.7, "accuracy": 0.8})
    state.eval_report(ev, good, 1.0)
    with pytest.raises(ProtocolError, match="bad_field") as refused:
        state.eval_report(ev, report, 2.0)
    assert field in str(refused.value)
    assert state.evaluations.eval is good and state.roster.members[ev].last_seen == 1.0
    assert state.status(2.0).metrics == {"loss": 0.7, "accuracy": 0.8}


def test_an_evaluation_at_the_bounds_is_kept() -> None:
    """At most 32 metrics of 64-character names; NaN test_acc is a task's mark for "no accuracy metric"."""
    state = _job()
    ev = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    metrics = {f"m{i:02d}" + "x" * 61: float(i) for i in range(31)} | {"loss": 0.5}
    state.eval_report(ev, EvalReport(version=1, test_loss=0.5, test_acc=float("nan"), metrics=metrics), 1.0)
    assert state.status(1.0).metrics.keys() == metrics.keys() and state.status(1.0).eval_version == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_evaluation_with_a_non_finite_figure_is_refused_and_changes_nothing(value: float) -> None:
    state = _job()
    ev = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    good = EvalReport(version=0, test_loss=0.7, test_acc=0.8, metrics={"loss": 0.7, "accuracy": 0.8})
    state.eval_report(ev, good, 1.0)
    for bad in (
        EvalReport(version=1, test_loss=value, test_acc=0.8, metrics={"loss": value, "accuracy": 0.8}),
        EvalReport(version=1, test_loss=0.6, test_acc=value, metrics={"loss": 0.6, "accuracy": value}),
    ):
        with pytest.raises(ProtocolError, match="bad_field: EVAL.* is not a finite number"):
            state.eval_report(ev, bad, 2.0)
    assert state.evaluations.eval is good and state.roster.members[ev].last_seen == 1.0


@pytest.mark.parametrize("policy", ["fixed", "dynamic"])
def test_a_workers_own_largest_batch_bounds_its_share_and_the_others_keep_the_global_batch(policy: str) -> None:
    state = _job(batch_policy=policy, reassign_threshold=0.0)
    small, big, other = _join(state, 3000.0, max_batch=16), _join(state, 1000.0), _join(state, 1000.0)
    assert state.allocator.allocation[small] == 16 and sum(state.allocator.allocation.values()) == 96
    assert state.status(0.0).workers[small].max_batch == 16
    for t in range(1, 30):  # the small worker is by far the fastest: unbounded, it would take most of B
        _step(state, small, 0.001 + 0.00005 * state.allocator.allocation[small], t * 0.1)
        for wid in (big, other):
            _step(state, wid, 0.001 + 0.001 * state.allocator.allocation[wid], t * 0.1)
    assert state.allocator.allocation[small] == 16 and sum(state.allocator.allocation.values()) == 96
    assert state.allocator.allocation[big] == state.allocator.allocation[other] == 40
    assert state.allocator.decisions[0].reason == "joined; bounds hold less than B", "alone, it cannot hold B"
    assert "bounds" not in state.allocator.decisions[-1].reason


def test_bounds_that_cannot_hold_the_global_batch_give_each_worker_its_bound_and_say_so_in_the_decision() -> None:
    state = _job(reassign_threshold=0.0)
    a = _join(state, 1000.0, max_batch=32)
    assert state.allocator.allocation == {a: 32}
    assert state.allocator.decisions[-1].reason == "joined; bounds hold less than B"
    b = _join(state, 1000.0, max_batch=40)
    assert state.allocator.allocation == {a: 32, b: 40}
    c = _join(state, 250.0)  # slow: it takes what the capped ones cannot
    assert state.allocator.allocation == {a: 32, b: 40, c: 24} and state.allocator.decisions[-1].reason == "joined"


def test_a_negative_max_batch_in_hello_is_refused_and_registers_nothing() -> None:
    state = _job()
    members = dict(state.roster.members)
    with pytest.raises(ProtocolError, match="bad_field.*max_batch|max_batch"):
        state.hello(Hello(role=Role.WORKER, max_batch=-1), 0.0)
    assert state.roster.members == members


def test_time_waiting_for_data_is_the_workers_own_and_makes_it_look_slower() -> None:
    """A starved loader slows a machine down like a slow GPU: its share shrinks; the wait is reported."""
    state = _job(reassign_threshold=0.0)
    fed, starved = _join(state, 1000.0), _join(state, 1000.0)
    for t in range(1, 40):
        for wid in (fed, starved):
            m = state.roster.members[wid]
            compute = 0.005 + 0.0005 * state.allocator.allocation[wid]
            data = 0.0005 * state.allocator.allocation[wid] if wid == starved else 0.0
            batch = state.allocator.allocation[wid]
            hb = WorkerHeartbeat(
                steps=m.steps + 1,
                samples=m.samples + batch,
                batch=batch,
                times=StepTimes(step_s=compute + data, compute_s=compute, data_s=data),
                standalone_sps=1000.0,
                loss=1.0,
            )
            state.heartbeat(wid, hb, t * 0.1)
    assert state.allocator.allocation[fed] > 1.5 * state.allocator.allocation[starved]
    status = state.status(4.0).workers[starved]
    assert status.times.data_s == pytest.approx(0.0005 * state.roster.members[starved].last.batch)
    assert status.data_s_total > 0 and state.status(4.0).workers[fed].data_s_total == 0.0
    m = state.roster.members[fed]
    before = (m.last, m.steps, m.data_s_total, dict(state.allocator.allocation))
    with pytest.raises(ProtocolError, match=r"HEARTBEAT\.times\.data_s must be finite"):
        state.heartbeat(
            fed, WorkerHeartbeat(steps=m.steps + 1, samples=m.samples, times=StepTimes(data_s=float("nan"))), 5.0
        )
    assert (m.last, m.steps, m.data_s_total, state.allocator.allocation) == before, "a refused report changes nothing"


def test_a_local_rounds_steps_reported_after_its_repeated_heartbeats_are_taken() -> None:
    """128 local steps reported 10 ms after a heartbeat that repeated the old counters: they were taken over the
    6 s since the counters last grew, so they fit (the bound used the time since the last heartbeat, and refused
    every round's report)."""
    state = _job(protocol="local")
    wid = _join(state, 100.0)
    before = state.roster.members[wid].last
    for now in (2.0, 4.0, 5.99):
        state.heartbeat(wid, before, now)
    m, batch = state.roster.members[wid], state.allocator.allocation[wid]
    round_end = WorkerHeartbeat(
        steps=128,
        samples=128 * batch,
        batch=batch,
        times=StepTimes(step_s=6.0, compute_s=6.0),
        standalone_sps=100.0,
        loss=1.0,
    )
    state.heartbeat(wid, round_end, 6.0)
    assert state.roster.members[wid].steps == 128
    with pytest.raises(ProtocolError, match="HEARTBEAT.steps grew by 1000"):
        state.heartbeat(wid, WorkerHeartbeat(steps=1128, samples=m.samples, batch=batch, standalone_sps=100.0), 6.01)


def test_silence_while_the_scheduler_itself_stalled_is_excused() -> None:
    """A 3 s stall of the scheduler's own loop (a slow fsync, a paused VM) must not drop workers that
    heartbeat all along; silence beyond it still does."""
    state = _job()
    wid = _join(state, 100.0)
    _step(state, wid, 0.1, now=1.0)
    state.roster.excuse(3.0)
    _shards_apply(state, 4.5)
    assert state.expire(4.5) == [], "3.5 s of silence, 3 s of it the scheduler's own"
    assert state.expire(6.1) == [wid]


def test_status_never_reports_a_batch_the_worker_does_not_hold() -> None:
    """The allocation owns a worker's batch: through speed updates, a worker's departure and its return as a new
    member, STATUS and the worker's own assignment always show the same batch."""
    state = _job(reassign_threshold=0.0, epochs=10.0)  # not at the end of its budget, where batches shrink
    fast, slow = _join(state, 3000.0), _join(state, 1000.0)

    def agree(now: float) -> None:
        shown = state.status(now).workers
        assert shown and all(shown[w].batch == state.assignment_for(state.roster.members[w]).batch for w in shown)

    for t in range(1, 10):
        _step(state, fast, 0.010 + 0.0002 * state.allocator.allocation[fast], t * 0.1)
        _step(state, slow, 0.010 + 0.0010 * state.allocator.allocation[slow], t * 0.1)
        agree(t * 0.1)
    state.bye(slow, 1.0)
    agree(1.0)
    _shards_apply(state, 1.0)  # the shards are told fast's larger batch: now it holds it
    agree(1.0)
    assert state.status(1.0).workers[fast].batch == 96
    again = _join(state, 1000.0, now=1.1)
    agree(1.1)
    assert state.status(1.1).workers[again].batch == state.allocator.allocation.get(again, 0)


@pytest.mark.parametrize("protocol", ["ssgd", "rennala"])
def test_a_round_protocol_leaves_out_a_worker_that_holds_up_every_round_and_says_why(protocol: str) -> None:
    state = _job(protocol=protocol, global_batch=96, min_batch=8, epochs=10.0)  # budget left: idle means left out
    fast = [_join(state, 1000.0) for _ in range(3)]
    slow = _join(state, 1000.0)
    for t in range(1, 12):
        for w in fast:
            _step(state, w, 0.004 + state.allocator.allocation.get(w, 0) * 0.0005, t * 0.1)
        if state.allocator.allocation.get(slow, 0):
            _step(state, slow, 0.400 + state.allocator.allocation.get(slow, 0) * 0.004, t * 0.1)
    assert state.allocator.allocation[slow] == 0 and state.assignment_for(state.roster.members[slow]).batch == 0
    assert sum(state.allocator.allocation[w] for w in fast) == 96
    assert "slowest left out" in state.allocator.decisions[-1].reason
    _shards_apply(state, 1.2)  # the fast workers' larger batches are bounded by the shards: they hold them
    told = state.shard_assignment()
    assert told.idle_workers == [slow] and told.allocated == 3 and slow in told.live_workers
    fast_batch = state.allocator.allocation[fast[0]]
    assert state.assignment_for(state.roster.members[fast[0]]).lr_scale == pytest.approx(min(1.0, fast_batch * 3 / 96))


def test_asynchronous_protocols_never_leave_a_worker_out() -> None:
    state = _job(protocol="asgd", global_batch=96, min_batch=8, epochs=10.0)
    fast = [_join(state, 1000.0) for _ in range(3)]
    slow = _join(state, 1000.0)
    for t in range(1, 12):
        for w in fast:
            _step(state, w, 0.004 + state.allocator.allocation.get(w, 0) * 0.0005, t * 0.1)
        _step(state, slow, 0.400 + state.allocator.allocation.get(slow, 0) * 0.004, t * 0.1)
    assert state.allocator.allocation[slow] >= 8 and not state.shard_assignment().idle_workers


@pytest.mark.parametrize("protocol", ["asgd", "softsync", "ssgd"])
def test_a_slow_link_keeps_its_compute_share_unless_a_round_waits_for_it(protocol: str) -> None:
    """Three workers computing 1,000 samples/s, two behind links whose transfers add 10 ms to each step, one behind
    a link that adds 150 ms (the heartbeats report the compute part apart, as a worker's do). asgd and softsync
    give the slow link the compute share (96 / 3) from its first step and keep it; ssgd, whose rounds would wait
    for it, gives it the equal-step batch, here none (the round is faster without it)."""
    state = _job(protocol=protocol, global_batch=96, min_batch=4)
    fast = [_join(state, 1000.0) for _ in range(2)]
    slow = _join(state, 1000.0)
    held = []
    for t in range(1, 21):
        for w in fast:
            compute_s = state.allocator.allocation.get(w, 0) * 0.001
            _step(state, w, 0.010 + compute_s, t * 0.1, compute_s=compute_s)
        if state.allocator.allocation.get(slow, 0):
            compute_s = state.allocator.allocation.get(slow, 0) * 0.001
            _step(state, slow, 0.150 + compute_s, t * 0.1, compute_s=compute_s)
        held.append(state.allocator.allocation[slow])
    assert sum(state.allocator.allocation.values()) == 96
    if protocol == "ssgd":
        assert held[-10:] == [0] * 10, held
    else:
        assert held == [32] * 20, held


def _two_stepping(protocol: str) -> tuple[JobState, str, str]:
    """A job of `protocol` (2 s liveness, epochs enough never to end) whose two workers have each taken five steps of
    0.05 s."""
    state = _job(protocol=protocol, liveness_timeout_s=2.0, epochs=1000.0)
    w0, w1 = _join(state, 1000.0), _join(state, 1000.0)
    for t in range(1, 6):
        _step(state, w0, 0.05, t * 0.1)
        _step(state, w1, 0.05, t * 0.1)
    return state, w0, w1


def test_a_worker_whose_steps_stop_while_its_heartbeat_goes_on_is_dropped_from_rounds_and_the_end() -> None:
    """Liveness is not progress: w1's heartbeat thread beats on (its last counters repeated) while its data
    loading hangs; after PROGRESS_STEPS of its own steps (at least three liveness timeouts) it is dropped and its
    share goes to w0, which kept stepping; a worker that merely waits for its first batch is not judged."""
    state, w0, w1 = _two_stepping("ssgd")
    frozen = state.roster.members[w1].last
    limit = progress_allowed_s(0.05, 2.0, state.job.join_timeout_s)
    assert limit == 3 * 2.0, "20 steps of 0.05 s are less than the floor of three liveness timeouts"
    now = 0.5
    while now < 0.5 + limit - 0.2:
        now += 0.2
        _step(state, w0, 0.05, now)
        state.heartbeat(w1, frozen, now)  # the pulse repeats its last counters
        _shards_apply(state, now)
        assert state.expire(now) == []
    now += 0.4
    _step(state, w0, 0.05, now)
    state.heartbeat(w1, frozen, now)
    _shards_apply(state, now)
    assert state.expire(now) == [w1]
    assert state.roster.members[w1].left and state.allocator.allocation == {w0: 96}
    last = state.allocator.decisions[-1]
    assert last.reason.startswith("no progress") and last.subject == w1
    late = _join(state, 1000.0, now=now + 0.1)  # it registers again: judged from its new batch, not its old steps
    _shards_apply(state, now + 0.2)
    assert state.expire(now + 0.2) == [] and state.allocator.batch_of(late) > 0


def test_a_worker_whose_every_push_is_discarded_is_computing_and_is_not_dropped_as_stuck() -> None:
    """Under Ringmaster a worker far slower than the rest has every gradient discarded as too stale: its steps
    stop growing while it computes and pushes. Its heartbeats count those steps in `discarded`, which is progress:
    it is not dropped (and made to register again) as one whose data loading hangs would be, after the same time."""
    state, w0, w1 = _two_stepping("ringmaster")
    last = state.roster.members[w1].last
    limit = progress_allowed_s(0.05, 2.0, state.job.join_timeout_s)
    now = 0.5
    while now < 0.5 + 3 * limit:
        now += 0.2
        _step(state, w0, 0.05, now)
        last = replace(last, discarded=last.discarded + 3)  # three steps computed and discarded since its last beat
        state.heartbeat(w1, last, now)
        _shards_apply(state, now)
        assert state.expire(now) == []
    assert not state.roster.members[w1].left and state.allocator.batch_of(w1) > 0


def test_a_discarded_count_that_goes_backwards_or_outgrows_the_time_is_refused_and_changes_nothing() -> None:
    state = _job(protocol="ringmaster")
    a = _join(state, 1000.0)
    _step(state, a, 0.05, 1.0)
    state.heartbeat(a, replace(state.roster.members[a].last, discarded=4), 1.1)
    kept = state.roster.members[a].last
    for hb, why in (
        (replace(kept, discarded=3), "went backwards"),
        (replace(kept, discarded=4 + 10_000_000), "discarded grew by"),
    ):
        with pytest.raises(ProtocolError, match=why):
            state.heartbeat(a, hb, 1.2)
        assert state.roster.members[a].last == kept


def _to_epochs(state: JobState, wid: str, t: float = 0.0) -> float:
    """Step `wid` until the job's samples reach its epochs; returns the time."""
    while state.progress.epoch < state.job.epochs:
        t += 0.1
        _step(state, wid, 0.05, t)
    return t


def test_the_job_ends_only_once_every_shard_has_reported_after_its_epochs_were_reached() -> None:
    """Workers report samples whose pushes shards already applied: a shard's second heartbeat after that was sent
    after them and judges the model that holds them."""
    state = _job()
    t = _to_epochs(state, _join(state, 1000.0))
    assert not state.stopping
    _shards_apply(state, t + 0.1)
    assert not state.stopping, "that heartbeat may have been sent before the last pushes"
    _shards_apply(state, t + 0.2)
    assert state.stopping


def test_a_job_whose_epochs_are_reached_while_a_shard_reports_its_model_sick_rolls_back_instead_of_ending() -> None:
    """Else the job would end at the model the rollback restores, without training the samples it threw away."""
    state = _job(max_rollbacks=2)
    wid = _join(state, 1000.0)
    t = _to_epochs(state, wid)
    ps = state.roster.shards[0]
    sick = ShardHeartbeat(
        version=20, samples=state.progress.samples, membership=state.roster.membership, model_problem="norm 1e9"
    )
    for dt in (0.1, 0.2, 0.3):
        state.shard_heartbeat(ps.id, sick, t + dt)
        assert not state.stopping, "the model that reached the epochs is not healthy"
    assert state.rollbacks.rollback_number == 1
    restored = ShardHeartbeat(version=4, samples=384, membership=state.roster.membership, rollbacks=1)
    state.shard_heartbeat(ps.id, restored, t + 0.4)
    state.shard_heartbeat(ps.id, restored, t + 0.5)
    assert state.progress.epoch < 1.0 and not state.stopping, "the samples lost to the rollback are trained again"


def test_an_evaluator_whose_evaluations_stop_while_its_heartbeat_goes_on_is_dropped_and_the_end_gives_up() -> None:
    """Liveness is not progress for an evaluator either: its heartbeat thread beats while its main thread hangs
    (a metric, the test set's loading). Judged by its own measured evaluations, it is dropped after its interval
    plus EVAL_ROUNDS of them (at least three liveness timeouts); the job, which awaited its final evaluation,
    ends without it once the join timeout passes with no evaluator, keeping the last real evaluation."""
    state = _job(await_final_eval=True, eval_interval_s=1.0, join_timeout_s=30.0)
    ev = state.hello(Hello(role=Role.EVALUATOR), 0.0).id
    for beat in (9.0, 18.0):  # past three liveness timeouts: loading the test set may take the join timeout
        state.heartbeat(ev, WorkerHeartbeat(), beat)
        _shards_apply(state, beat)
        assert state.expire(beat) == [], "before its first evaluation it has the join timeout"
    state.eval_report(ev, EvalReport(version=0, test_loss=2.3, test_acc=0.1), 20.0)
    state.eval_report(ev, EvalReport(version=0, test_loss=2.2, test_acc=0.2), 21.5)  # 1 s apart plus 0.5 s
    assert state.roster.members[ev].eval_s == pytest.approx(0.5)
    allowed = evaluation_allowed_s(0.5, 1.0, 2.0, 30.0)
    assert allowed == 1.0 + 3 * 2.0, "three evaluations of 0.5 s are less than the floor of three liveness timeouts"
    t = _run_to_target(state, _join(state, 1000.0, now=21.5), 21.5)
    assert t < 21.5 + allowed - 0.1
    state.tick(t)
    for now, dropped in ((21.5 + allowed - 0.1, []), (21.5 + allowed + 0.1, [ev])):
        state.heartbeat(ev, WorkerHeartbeat(), now)  # the pulse goes on: liveness is not progress
        _shards_apply(state, now)
        assert state.expire(now) == dropped and not state.finished
    assert state.tick(t + 31.0) and state.finished, "after the join timeout with no evaluator the job ends"
    status = state.status(t + 31.0)
    given_up = status.final_eval_given_up
    assert given_up.startswith(f"evaluator {ev} (") and "reported no evaluation for" in given_up, given_up
    assert status.test_acc == 0.2 and not status.final_eval, "the accuracy is the last real evaluation's"


def test_a_job_without_an_evaluator_says_why_its_awaited_final_evaluation_was_given_up() -> None:
    state = _job(await_final_eval=True, join_timeout_s=30.0)
    t = _run_to_target(state, _join(state, 1000.0))
    state.tick(t)
    assert state.status(t).final_eval_given_up == "", "not yet given up"
    state.tick(t + 31.0)
    assert state.status(t + 31.0).final_eval_given_up == "no evaluator joined within 30 s of the job's end"


def test_a_heartbeat_of_the_other_roles_kind_is_refused_and_changes_nothing() -> None:
    """A worker reports with HEARTBEAT and a shard with SHARD_HEARTBEAT: the other kind in a member's name is
    refused (`bad_sender`) before anything of it is taken."""
    state = _job()
    wid = _join(state, 1000.0)
    worker, shard = state.roster.members[wid], state.roster.shards[0]
    before = (worker.heartbeats, worker.last, shard.heartbeats, shard.shard_last, state.roster.membership)
    with pytest.raises(ProtocolError, match=f"bad_sender: {wid} is a worker; it reports with HEARTBEAT"):
        state.shard_heartbeat(wid, ShardHeartbeat(version=5, samples=480, quarantined=[wid]), 1.0)
    with pytest.raises(ProtocolError, match=f"bad_sender: {shard.id} is a ps; it reports with SHARD_HEARTBEAT"):
        state.heartbeat(shard.id, WorkerHeartbeat(steps=1, samples=32, batch=32, times=StepTimes(step_s=0.1)), 1.0)
    assert (worker.heartbeats, worker.last, shard.heartbeats, shard.shard_last, state.roster.membership) == before
    assert wid in state.roster.live_workers


def test_a_shards_report_of_who_pushed_times_each_workers_first_push_from_its_batch() -> None:
    """ShardHeartbeat.pushed: the scheduler times a worker's first push from the batch it handed it, once; a name
    that holds no batch here (a stranger, a shard) is not remembered."""
    state = _job(batch_policy="auto")
    w0, w1 = _join(state, 1000.0, now=1.0), _join(state, 1000.0, now=2.0)
    given = {w: state.roster.members[w].batch_given_at for w in (w0, w1)}
    shard = next(iter(state.roster.shards.values()))
    state.shard_heartbeat(shard.id, ShardHeartbeat(pushed=[w0, "stranger", shard.id]), 5.0)
    state.shard_heartbeat(shard.id, ShardHeartbeat(pushed=[w0, w1]), 7.5)
    state.shard_heartbeat(shard.id, ShardHeartbeat(pushed=[w0, w1]), 9.0)
    held = state.allocator.allocation
    assert state.allocator.tally.first_push == {w0: (5.0 - given[w0], held[w0]), w1: (7.5 - given[w1], held[w1])}
    with pytest.raises(ProtocolError, match="twice"):
        state.shard_heartbeat(shard.id, ShardHeartbeat(pushed=[w0, w0]), 9.5)
