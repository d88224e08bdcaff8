"""Membership (scheduler/roster.py) driven directly: registration, connection binding, silence, departures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.scheduler.roster import DEPARTED_KEPT, GAPS_KEPT, LIVENESS_GAPS, Roster, silence_allowed


def _roster(num_shards: int = 1, **kw: Any) -> Roster:
    roster = Roster(
        JobConfig(**{"dataset": "synthetic", "liveness_timeout_s": 2.0, "join_timeout_s": 30.0, **kw}), num_shards
    )
    for _ in range(num_shards):
        roster.register(Hello(role=Role.SHARD, endpoint="tcp://ps:1"), 0.0, b"ps", lambda: None)
    return roster


def _refused(code: str, call: Callable[[], object]) -> None:
    with pytest.raises(ProtocolError) as err:
        call()
    assert err.value.code == code, err.value


def test_shards_take_slots_and_workers_wait_for_all_of_them() -> None:
    roster = Roster(JobConfig(dataset="synthetic"), 2)
    assert (
        roster.register(Hello(role=Role.SHARD, shard_index=1, endpoint="tcp://b:1"), 0.0, b"", lambda: None).id == "ps1"
    )
    _refused("not_ready", lambda: roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None))
    _refused("slot_taken", lambda: roster.register(Hello(role=Role.SHARD, shard_index=1), 0.0, b"", lambda: None))
    _refused("bad_field", lambda: roster.register(Hello(role=Role.SHARD, shard_index=2), 0.0, b"", lambda: None))
    assert roster.register(Hello(role=Role.SHARD, endpoint="tcp://a:1"), 0.0, b"", lambda: None).id == "ps0"
    _refused("no_slot", lambda: roster.register(Hello(role=Role.SHARD), 0.0, b"", lambda: None))
    assert roster.shard_endpoints() == ["tcp://a:1", "tcp://b:1"]
    assert roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None).id == "w0"
    assert roster.register(Hello(role=Role.EVALUATOR), 0.0, b"", lambda: None).id == "eval0"


def test_a_refused_admission_makes_no_member_and_uses_no_id() -> None:
    roster = _roster()

    def refuse() -> None:
        raise ProtocolError("hello_rate", "too many")

    _refused("hello_rate", lambda: roster.register(Hello(role=Role.WORKER), 0.0, b"w", refuse))
    assert [m.id for m in roster.members.values()] == ["ps0"] and roster.next_id["worker"] == 0
    assert roster.register(Hello(role=Role.WORKER), 0.0, b"w", lambda: None).id == "w0"


def test_the_job_admits_at_most_max_workers() -> None:
    roster = _roster(max_workers=2)
    roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    roster.register(Hello(role=Role.EVALUATOR), 0.0, b"", lambda: None)
    _refused("full", lambda: roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None))


def test_hello_fields_that_cannot_be_are_refused() -> None:
    roster = _roster()
    _refused("bad_field", lambda: roster.check_hello(Hello(role=Role.WORKER, instance="x" * 65)))
    _refused("bad_field", lambda: roster.check_hello(Hello(role=Role.WORKER, max_batch=-1)))
    roster.check_hello(Hello(role=Role.WORKER, instance="x" * 64, max_batch=8))


@pytest.mark.parametrize(
    "hello",
    [
        Hello(role=Role.WORKER, name="n" * 129),
        Hello(role=Role.WORKER, name="a\x1b[2Jb"),
        Hello(role=Role.WORKER, name=" padded"),
        Hello(role=Role.WORKER, slowdown="fast"),
        Hello(role=Role.WORKER, slowdown="0.5x"),
        Hello(role=Role.WORKER, slowdown=",".join(f"2x@{i}s" for i in range(1, 20))),
    ],
)
def test_a_name_or_slowdown_that_stdout_or_status_could_not_show_is_refused(hello: Hello) -> None:
    """Both reach every STATUS reply and the console's progress line: bounded, printable, a slowdown schedule."""
    _refused("bad_field", lambda: _roster().check_hello(hello))


def test_status_shows_each_workers_name_and_slowdown_as_the_scheduler_reads_it() -> None:
    roster = _roster()
    w = roster.register(Hello(role=Role.WORKER, name="n" * 128, slowdown="4"), 0.0, b"", lambda: None)
    plain = roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    assert (w.public(8).name, w.public(8).slowdown) == ("n" * 128, "4x")
    assert (plain.public(8).name, plain.public(8).slowdown) == (plain.id, ""), "no slowdown reported: none shown"


def test_a_member_is_bound_to_its_connection_and_a_process_rebinds_by_its_instance() -> None:
    roster = _roster()
    w = roster.register(Hello(role=Role.WORKER, instance="proc-1"), 0.0, b"conn-1", lambda: None)
    assert roster.member(w.id, b"conn-1") is w
    _refused("bad_sender", lambda: roster.member(w.id, b"conn-2"))
    _refused("unknown_sender", lambda: roster.member("w9", b"conn-1"))
    assert roster.rebind(Hello(role=Role.EVALUATOR, instance="proc-1"), 1.0, b"conn-2") is None, "another role"
    assert roster.rebind(Hello(role=Role.WORKER, instance="proc-1"), 1.0, b"conn-2") is w
    assert roster.member(w.id, b"conn-2") is w and w.last_seen == 1.0
    roster.leave(w)
    assert roster.rebind(Hello(role=Role.WORKER, instance="proc-1"), 2.0, b"conn-3") is None, "it left: a new member"
    assert roster.has_left(w.id) and not roster.has_left("w9")


def test_only_a_live_worker_that_reported_its_speed_changes_the_membership() -> None:
    roster = _roster()
    loading = roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    assert roster.live_workers == [] and roster.membership == 0
    assert roster.leave(loading) is False and roster.membership == 0, "never live: nothing for the shards to learn"
    ready = roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    roster.admit_worker(ready)
    assert roster.live_workers == [ready.id] and ready.admitted_in == roster.membership == 1
    assert not roster.known_to_shards(ready)
    roster.shards[0].shard_last = ShardHeartbeat(membership=1)
    assert roster.known_to_shards(ready)
    assert roster.leave(ready) is True and roster.membership == 2 and roster.live_workers == []


def test_a_shard_that_leaves_frees_its_slot() -> None:
    roster = _roster()
    shard = roster.shards[0]
    assert roster.leave(shard) is False
    assert roster.shards == {}
    assert roster.register(Hello(role=Role.SHARD, shard_index=0), 1.0, b"", lambda: None).id == "ps0"


def test_silence_follows_the_role_and_the_members_own_steps() -> None:
    roster = _roster()
    shard, worker = roster.shards[0], roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    assert silence_allowed(shard, roster.job) == 30.0, "a shard restores its checkpoint before its first heartbeat"
    assert silence_allowed(worker, roster.job) == 2.0
    worker.last = WorkerHeartbeat(times=StepTimes(step_s=5.0))
    assert silence_allowed(worker, roster.job) == 15.0, "three of its own steps"
    worker.last = WorkerHeartbeat(times=StepTimes(step_s=100.0))
    assert silence_allowed(worker, roster.job) == 30.0, "capped by the join timeout"
    worker.last = WorkerHeartbeat()
    assert roster.silent(2.5) == [worker]
    roster.excuse(1.0)
    assert roster.silent(2.5) == [], "the scheduler's own stall is nobody's silence"


def test_workers_silent_all_at_once_are_held_until_the_join_timeout_and_one_silent_alone_is_not() -> None:
    """Two live workers past their allowance together: a stall of their host or of the scheduler's link, which a
    drop of both would turn into the job's end."""
    roster = _roster()
    a, b = (roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None) for _ in range(2))
    a.heartbeats = b.heartbeats = 1
    assert silence_allowed(a, roster.job) == 2.0 and roster.job.join_timeout_s == 30.0
    assert roster.hold_news(1.5) is None, "nobody is held before the allowance runs out"
    assert roster.silent(2.5) == [] and roster.held(2.5) == [a, b], "both silent: held"
    started = roster.hold_news(2.5)
    assert started is not None and f"every worker fell silent at once ({a.id}, {b.id};" in started
    assert "for up to 30 s (--join-timeout-s)" in started and roster.hold_news(3.0) is None, "said once"
    roster.shards[0].heard(30.0)
    assert roster.silent(30.5) == [a, b], "held no longer than the join timeout"
    assert "held as every worker fell silent at once" in roster.why_silent(a, 30.5)
    for m in (a, b):
        roster.leave(m)
    assert roster.hold_news(30.5) == "the hold ended after 28.0 s: no held worker was heard again"
    roster = _roster()
    a, b = (roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None) for _ in range(2))
    a.heartbeats = b.heartbeats = 1
    b.heard(2.0)
    assert roster.silent(2.5) == [a], "b still heartbeats: a's silence is its own"
    assert roster.why_silent(a, 2.5) == f"{a.id} stopped sending heartbeats: none for 2.5 s, 2.0 s allowed (after 1)"


def test_a_hold_ends_when_a_held_worker_is_heard_again() -> None:
    """The operator reads the hold's start and end as they happen; its end names who came back."""
    roster = _roster()
    a, b = (roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None) for _ in range(2))
    a.heartbeats = b.heartbeats = 1
    assert roster.hold_news(2.5) is not None
    b.heard(3.0)
    assert roster.silent(3.0) == [a], "b is back: a's silence is now its own"
    roster.leave(a)
    assert roster.hold_news(3.0) == f"the hold ended after 0.5 s: heard again from {b.id}"
    assert roster.hold_news(3.5) is None


def test_silence_follows_the_members_own_recent_gaps_between_heartbeats() -> None:
    """A live process on an oversubscribed machine heartbeats late; a member is allowed LIVENESS_GAPS times its
    heartbeats' longest recent lateness, capped by the join timeout, and an old gap stops counting once GAPS_KEPT
    newer ones came."""
    roster = _roster(heartbeat_s=0.2)
    worker = roster.register(Hello(role=Role.WORKER), 0.0, b"", lambda: None)
    worker.heard(9.0)  # its first report, after loading: no gap of its heartbeats yet
    worker.heartbeats = 1
    assert silence_allowed(worker, roster.job) == 2.0
    now = worker.last_seen
    for gap in (0.2, 0.2, 1.7, 0.2):  # 1.5 s late, at a heartbeat every 0.2 s
        now += gap
        worker.heard(now)
    assert silence_allowed(worker, roster.job) == pytest.approx(LIVENESS_GAPS * 1.5)
    assert roster.silent(now + 4.0) == [] and roster.silent(now + LIVENESS_GAPS * 1.5 + 0.1) == [worker]
    assert (
        roster.why_silent(worker, now + 4.6)
        == f"{worker.id} stopped sending heartbeats: none for 4.6 s, 4.5 s allowed (after 1)"
    )
    worker.heard(now + 20.0)
    assert silence_allowed(worker, roster.job) == 30.0, "capped by the join timeout"
    for _ in range(GAPS_KEPT):
        now = worker.last_seen + 0.2
        worker.heard(now)
    assert silence_allowed(worker, roster.job) == 2.0, "the long gaps have rolled off"


def test_a_quarantined_process_may_not_join_again() -> None:
    roster = _roster()
    w = roster.register(Hello(role=Role.WORKER, instance="liar"), 0.0, b"", lambda: None)
    roster.quarantine(w)
    roster.leave(w)
    _refused("quarantined", lambda: roster.check_hello(Hello(role=Role.WORKER, instance="liar")))
    roster.check_hello(Hello(role=Role.WORKER, instance="honest"))


def test_the_member_table_keeps_a_bounded_number_of_departed_members() -> None:
    roster = _roster(max_workers=DEPARTED_KEPT + 10)
    first = roster.register(Hello(role=Role.WORKER, instance="first"), 0.0, b"", lambda: None)
    roster.leave(first)
    for i in range(DEPARTED_KEPT):
        roster.leave(roster.register(Hello(role=Role.WORKER, instance=f"p{i}"), 0.0, b"", lambda: None))
    roster.forget_departed()
    assert first.id not in roster.members and "first" not in roster.instances
    assert sum(1 for m in roster.members.values() if m.left) == DEPARTED_KEPT


def test_each_member_is_numbered_among_its_roles_members_as_its_id_counts_it() -> None:
    """A worker seeds its order of the training set with its number (Welcome.number, worker/batch_source.py),
    which the roster counts per role, as the id it gives (a shard's is its index)."""
    roster = _roster(num_shards=2)
    members = [
        roster.register(Hello(role=role, instance=f"{role}-{i}"), 0.0, f"{role}{i}".encode(), lambda: None)
        for role in (Role.WORKER, Role.EVALUATOR)
        for i in range(3)
    ]
    assert [(m.id, m.number) for m in members] == [
        ("w0", 0),
        ("w1", 1),
        ("w2", 2),
        ("eval0", 0),
        ("eval1", 1),
        ("eval2", 2),
    ]
    assert [(m.id, m.number) for m in roster.shards.values()] == [("ps0", 0), ("ps1", 1)]
