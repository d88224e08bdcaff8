"""The worker's heartbeat keeper (worker/heartbeats.py, `HeartbeatKeeper`) against a ROUTER socket in this process
that answers as the scheduler does (scheduler_socket.py): a wait on shards ends early when the scheduler dropped
the worker, the job rolled back or the process was told to stop, and only a training process (one that acted on a
rollback) hears of rollbacks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.wire.messages import Error, Hello, Role, WorkerAssignment, WorkerHeartbeat
from dynabatch.worker.heartbeats import HeartbeatKeeper, Stopping
from harness import wait_for
from scheduler_socket import SchedulerSocket


@pytest.fixture
def keeper() -> Iterator[tuple[HeartbeatKeeper, SchedulerSocket, list[float]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    scheduler = SchedulerSocket(ctx)
    scheduler.answer = WorkerAssignment(assignment_id=1)
    link = SchedulerLink(ctx, scheduler.endpoint, "j", "test", WorkerHeartbeat, WorkerAssignment)
    ticks: list[float] = []
    assert link.register(Hello(role=Role.WORKER), lambda: False, lambda: None) is not None
    try:
        yield HeartbeatKeeper(link, lambda: ticks.append(time.monotonic()), lambda: False), scheduler, ticks
    finally:
        link.conn.sock.close(linger=0)
        scheduler.close()


def _answered(keeper: HeartbeatKeeper, scheduler: SchedulerSocket, beats: int) -> None:
    """Wait until the scheduler took `beats` heartbeats and its answer to the last is in."""
    wait_for(f"{beats} heartbeats", lambda: len(scheduler.got) >= beats, 10)
    wait_for("the answer", lambda: keeper.link.wait(0.05) is not None or keeper.link.lost, 10)


def test_it_repeats_the_last_heartbeat_and_is_due_again_an_interval_later(
    keeper: tuple[HeartbeatKeeper, SchedulerSocket, list[float]],
) -> None:
    beat, scheduler, ticks = keeper
    beat.interval_s = 60.0
    report = WorkerHeartbeat(steps=2, samples=64, batch=32)
    beat.send(report)
    beat.when_due()  # sent just now: nothing
    beat.repeat()
    wait_for("two heartbeats", lambda: len(scheduler.got) == 2, 10)
    assert [repr(b) for _, b in scheduler.got] == [repr(report)] * 2 and len(ticks) == 1  # repr: NaN loss
    assert beat.next_at > time.monotonic() + 50


def test_a_rollback_ends_a_wait_only_once_the_process_trains(
    keeper: tuple[HeartbeatKeeper, SchedulerSocket, list[float]],
) -> None:
    beat, scheduler, _ = keeper
    scheduler.answer = WorkerAssignment(assignment_id=1, rollbacks=1)
    beat.send(WorkerHeartbeat())
    _answered(beat, scheduler, 1)
    beat.repeat()  # an evaluator (rollbacks None) hears nothing of rollbacks
    beat.rollbacks = 1
    beat.repeat()  # the one it acted on already
    beat.rollbacks = 0
    with pytest.raises(RemoteError) as ended:
        beat.repeat()
    assert ended.value.code == "rolled_back"


def test_a_dropped_process_ends_its_wait_at_the_next_heartbeat_that_is_due(
    keeper: tuple[HeartbeatKeeper, SchedulerSocket, list[float]],
) -> None:
    beat, scheduler, _ = keeper
    scheduler.answer = Error("unknown_sender", "who are you")
    beat.send(WorkerHeartbeat())
    _answered(beat, scheduler, 1)
    beat.next_at = 0.0
    with pytest.raises(RemoteError) as ended:
        beat.when_due()
    assert ended.value.code == "unknown_sender"


def test_a_process_told_to_stop_ends_its_wait_without_another_heartbeat(
    keeper: tuple[HeartbeatKeeper, SchedulerSocket, list[float]],
) -> None:
    beat, scheduler, ticks = keeper
    beat.send(WorkerHeartbeat())
    _answered(beat, scheduler, 1)
    beat.stopping = lambda: True
    with pytest.raises(Stopping):
        beat.repeat()
    beat.next_at = 0.0
    with pytest.raises(Stopping):
        beat.when_due()
    assert len(scheduler.got) == 1 and not ticks, "nothing sent once stopping"
