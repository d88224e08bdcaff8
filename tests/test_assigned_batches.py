"""The scheduler tells shards each worker's batch (ShardAssignment.batches), and lets the worker use a larger one only
once every shard reports it applied it (ShardHeartbeat.batches); STATUS shows each worker the batch it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import Hello, Role, ShardAssignment, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.job_state import JobState
from dynabatch.scheduler.outage_clock import ClockReading


def test_a_worker_gets_a_larger_batch_only_once_every_shard_reports_it_bounds_its_pushes_by_it() -> None:
    """Counted as told when the answer was sent, a shard busy with a burst of pushes read its answer after the fast
    worker's first push of the larger batch, and refused an honest push (test_membership, beside a second suite)."""
    state = JobState(JobConfig(dataset="synthetic", global_batch=96), num_shards=2, train_size=1000, now=0.0)
    shards = [state.hello(Hello(role=Role.SHARD, endpoint=f"tcp://s:{i}", shard_index=i), 0.0).id for i in range(2)]
    a = state.hello(Hello(role=Role.WORKER), 0.0).id
    b = state.hello(Hello(role=Role.WORKER), 0.0).id
    for w in (a, b):
        state.heartbeat(w, WorkerHeartbeat(standalone_sps=1000.0), 0.1)
    for ps in shards:
        state.shard_heartbeat(ps, ShardHeartbeat(membership=state.roster.membership), 0.2)
    assert state.allocator.allocation == {a: 48, b: 48}
    assert state.assignment_for(state.roster.members[a]).batch == 0, "each shard was answered before the share"
    sent = state.shard_heartbeat(shards[0], ShardHeartbeat(membership=state.roster.membership, batches={}), 0.3)
    assert sent.batches == {a: 48, b: 48}
    state.shard_heartbeat(shards[0], ShardHeartbeat(membership=sent.membership, batches=sent.batches), 0.4)
    assert state.assignment_for(state.roster.members[a]).batch == 0, "shard 1 has not reported it applied a's bound"
    state.shard_heartbeat(shards[1], ShardHeartbeat(membership=sent.membership, batches=sent.batches), 0.45)
    assert state.assignment_for(state.roster.members[a]).batch == 48

    state.bye(b, 0.5)  # a's share grows to the whole batch
    assert state.allocator.allocation == {a: 96}
    assert state.assignment_for(state.roster.members[a]).batch == 48, "no shard knows a's larger batch yet"
    sent = state.shard_heartbeat(shards[0], ShardHeartbeat(membership=sent.membership, batches=sent.batches), 0.6)
    assert sent.batches == {a: 96}
    assert state.assignment_for(state.roster.members[a]).batch == 48, "sent to shard 0, not yet applied"
    with pytest.raises(ProtocolError, match="bad_field"):
        state.shard_heartbeat(
            shards[0], ShardHeartbeat(membership=sent.membership, batches={a: state.job.max_batch + 1}), 0.7
        )
    state.shard_heartbeat(shards[0], ShardHeartbeat(membership=sent.membership, batches=sent.batches), 0.8)
    assert state.assignment_for(state.roster.members[a]).batch == 48, "shard 1 still bounds a by 48"
    state.shard_heartbeat(shards[1], ShardHeartbeat(membership=sent.membership, batches=sent.batches), 0.9)
    assert state.assignment_for(state.roster.members[a]).batch == 96


def _status_batches_are_held(state: JobState, now: float) -> dict[str, int]:
    """STATUS shows each live worker the batch its own assignment gives it, never more than the allocation's;
    returns them."""
    shown = {wid: w.batch for wid, w in state.status(now).workers.items()}
    for wid, batch in shown.items():
        assert batch == state.assignment_for(state.roster.members[wid]).batch, (wid, shown)
        assert batch <= state.allocator.allocation.get(wid, 0), (wid, shown, state.allocator.allocation)
    return shown


@dataclass
class Shards:
    """Two shards that each report, in every heartbeat, the live set and bounds they applied: those of the answer
    to their previous heartbeat (a real shard applies an answer as it arrives)."""

    state: JobState
    ids: list[str]
    applied: dict[str, ShardAssignment] = field(default_factory=dict)

    def answer(self, now: float, which: tuple[int, ...] = (0, 1)) -> None:
        for ps in (self.ids[i] for i in which):
            last = self.applied.get(ps)
            hb = ShardHeartbeat() if last is None else ShardHeartbeat(membership=last.membership, batches=last.batches)
            self.applied[ps] = self.state.shard_heartbeat(ps, hb, now)


def _two_shards(cfg: JobConfig, now: float = 0.0) -> tuple[JobState, Shards]:
    state = JobState(cfg, num_shards=2, train_size=1000, now=now)
    shards = [
        state.hello(Hello(role=Role.SHARD, endpoint=f"tcp://s:{i}", shard_index=i, instance=f"ps-{i}"), now).id
        for i in range(2)
    ]
    return state, Shards(state, shards)


def test_status_never_shows_a_batch_the_worker_does_not_hold() -> None:
    """Not after a reset of the allocation, nor once a worker dropped, nor while shards learn a larger batch."""
    state, shards = _two_shards(JobConfig(dataset="synthetic", global_batch=96, liveness_timeout_s=2.0))
    a = state.hello(Hello(role=Role.WORKER), 0.0).id
    b = state.hello(Hello(role=Role.WORKER), 0.0).id
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), 0.1)
    shards.answer(0.2)  # the shards learn a
    shards.answer(0.3)  # and report it: a's share is made, after shard 0's answer
    assert state.allocator.allocation == {a: 96}
    shards.answer(0.35)
    assert _status_batches_are_held(state, 0.35) == {a: 0, b: 0}, "shard 0 has not applied a's bound yet"
    shards.answer(0.38)
    assert _status_batches_are_held(state, 0.38) == {a: 96, b: 0}, "b has not reported its speed yet"

    state.heartbeat(b, WorkerHeartbeat(standalone_sps=1000.0), 0.4)  # measured, but no shard has applied it yet
    state.bye(a, 0.5)  # the only worker the shards know leaves: nobody is ready, the allocation is reset
    assert state.allocator.allocation == {}
    assert _status_batches_are_held(state, 0.5) == {b: 0}, "the reset leaves nobody a batch"

    shards.answer(0.6, (0,))  # shard 0 learns b; shard 1 has not yet
    shards.answer(0.7, (1,))
    assert state.allocator.allocation == {}
    shards.answer(0.8)  # both report b: it gets the whole batch, which neither has applied
    assert state.allocator.allocation == {b: 96}
    assert _status_batches_are_held(state, 0.8) == {b: 0}
    shards.answer(0.85)
    assert _status_batches_are_held(state, 0.85) == {b: 0}, "shard 0's answer was made before b's share"
    shards.answer(0.88)
    assert _status_batches_are_held(state, 0.88) == {b: 96}

    c = state.hello(Hello(role=Role.WORKER), 0.9).id
    state.heartbeat(c, WorkerHeartbeat(standalone_sps=1000.0), 1.0)
    shards.answer(1.1)
    shards.answer(1.2)  # c joins once both shards report it: b's share shrinks at once
    assert state.allocator.allocation == {b: 48, c: 48}
    assert _status_batches_are_held(state, 1.2) == {b: 48, c: 0}
    shards.answer(1.3)
    assert _status_batches_are_held(state, 1.3) == {b: 48, c: 0}, "shard 0's answer was made before c's share"
    shards.answer(1.4)
    assert _status_batches_are_held(state, 1.4) == {b: 48, c: 48}
    for t in (2.0, 3.0, 4.0):  # c falls silent and is dropped
        state.heartbeat(b, WorkerHeartbeat(standalone_sps=1000.0), t)
        shards.answer(t)
        _status_batches_are_held(state, t)
    assert state.expire(4.0) == [c]
    assert state.allocator.allocation == {b: 96}
    assert _status_batches_are_held(state, 4.0) == {b: 48}, "the shards bound b by 48, all it was handed since c"
    shards.answer(4.1)
    assert _status_batches_are_held(state, 4.1) == {b: 48}, "both were sent b's larger bound, neither applied it"
    shards.answer(4.2)
    assert _status_batches_are_held(state, 4.2) == {b: 96}
    assert c not in state.status(4.0).workers and c in state.status(4.0).departed


def test_status_never_shows_a_batch_after_a_resume_before_the_shards_bound_it() -> None:
    cfg = JobConfig(dataset="synthetic", global_batch=96)
    state, shards = _two_shards(cfg)
    a = state.hello(Hello(role=Role.WORKER, instance="w-a"), 0.0).id
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), 0.1)
    for t in (0.2, 0.3, 0.35, 0.38):
        shards.answer(t)
    assert _status_batches_are_held(state, 0.38) == {a: 96}

    again, shards = _two_shards(cfg, now=10.0)
    again.resume(state.saved(0.4, ClockReading(100.0)), 10.0, ClockReading(100.0))
    rejoined = again.hello(Hello(role=Role.WORKER, instance="w-a"), 10.1).id
    assert _status_batches_are_held(again, 10.1) == {rejoined: 0}, "nothing is allocated after a resume"
    again.heartbeat(rejoined, WorkerHeartbeat(standalone_sps=1000.0), 10.2)
    shards.answer(10.3, (0,))
    shards.answer(10.4, (1,))
    assert _status_batches_are_held(again, 10.4) == {rejoined: 0}
    shards.answer(10.5)
    assert again.allocator.allocation == {rejoined: 96}
    assert _status_batches_are_held(again, 10.5) == {rejoined: 0}, "no shard has been sent its bound yet"
    shards.answer(10.6)
    assert _status_batches_are_held(again, 10.6) == {rejoined: 0}, "shard 0's answer was made before its share"
    shards.answer(10.7)
    assert _status_batches_are_held(again, 10.7) == {rejoined: 96}


def test_a_restarted_shard_bounds_a_worker_by_every_batch_it_may_still_be_stepping_with() -> None:
    """Each decision shrinks a's share while it is in one long step with the batch it was handed first: a shard that
    restarts then must still take that step's push, though two decisions came since (test_membership's
    shard-restart failure: "PUSH.samples 58 exceeds 53")."""
    state, shards = _two_shards(JobConfig(dataset="synthetic", global_batch=96))
    a = state.hello(Hello(role=Role.WORKER), 0.0).id
    state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), 0.1)
    for t in (0.2, 0.3, 0.35, 0.38):
        shards.answer(t)
    first = state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), 0.4)
    assert first.batch == 96, "a starts a step with the whole batch"
    for t in (1.0, 2.0):  # two workers join, one decision each: a's share shrinks twice
        joiner = state.hello(Hello(role=Role.WORKER), t).id
        state.heartbeat(joiner, WorkerHeartbeat(standalone_sps=1000.0), t + 0.1)
        for dt in (0.2, 0.25, 0.3, 0.35):
            shards.answer(t + dt)
        state.heartbeat(a, WorkerHeartbeat(standalone_sps=1000.0), t + 0.4)  # a's pulse: it is handed the smaller share
    assert state.allocator.allocation[a] == 32 and state.allocator.assignment_id >= first.assignment_id + 2

    state.bye(shards.ids[1], 2.9)
    restarted = state.hello(Hello(role=Role.SHARD, endpoint="tcp://s:1", shard_index=1, instance="ps-1-again"), 3.0).id
    told = state.shard_heartbeat(restarted, ShardHeartbeat(), 3.1)
    assert told.batches[a] == 96, "the restarted shard learns the batch a's step in flight was handed"
    assert state.assignment_for(state.roster.members[a]).batch == 0, "until it reports a's bound, a holds none"
    state.shard_heartbeat(restarted, ShardHeartbeat(membership=told.membership, batches=told.batches), 3.15)
    assert state.assignment_for(state.roster.members[a]).batch == 32

    state.heartbeat(
        a,
        WorkerHeartbeat(
            standalone_sps=1000.0,
            steps=1,
            samples=96,
            batch=96,
            times=StepTimes(step_s=0.5),
            assignment_id=first.assignment_id,
        ),
        3.2,
    )
    assert _bounds_sent(state, shards.ids[0], 3.3)[a] == 96, "its step under the first assignment is reported"
    state.heartbeat(
        a,
        WorkerHeartbeat(
            standalone_sps=1000.0,
            steps=2,
            samples=128,
            batch=32,
            times=StepTimes(step_s=0.2),
            assignment_id=state.allocator.assignment_id,
        ),
        3.4,
    )
    assert _bounds_sent(state, shards.ids[0], 3.5)[a] == 32, "a steps under the newest assignment: 96 is gone"


def _bounds_sent(state: JobState, shard: str, now: float) -> dict[str, int]:
    return state.shard_heartbeat(shard, ShardHeartbeat(membership=state.roster.membership), now).batches
