"""The worker's heartbeat keeper (worker/heartbeats.py, `HeartbeatKeeper`) against a ROUTER socket in this process
that answers as the scheduler does: a wait on shards ends early when the scheduler dropped the worker or the job
rolled back, and only a training process (one that acted on a rollback) hears of rollbacks."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from dynabatch.common.messages import Assignment, Error, Heartbeat, Hello, Welcome
from dynabatch.common.scheduler_link import SchedulerLink
from dynabatch.common.transport import RemoteError, recv_routed, send_routed
from dynabatch.worker.heartbeats import HeartbeatKeeper
from harness import free_port, wait_for


class Scheduler:
    """A ROUTER on a thread of its own: welcomes a HELLO, keeps every heartbeat, and answers each with `answer`."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)
        self.answer: object = Assignment(assignment_id=1)
        self.beats: list[Heartbeat] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            if not self.sock.poll(10):
                continue
            msg = recv_routed(self.sock)
            body = msg.message.body
            if isinstance(body, Hello):
                reply: object = Welcome(id="w0", config={}, shards=[])
            else:
                self.beats.append(body)
                reply = self.answer
            send_routed(self.sock, msg.identity, reply, msg.message.seq, "j", "scheduler")

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        self.sock.close(linger=0)


@pytest.fixture
def keeper():
    ctx = zmq.Context.instance()
    scheduler = Scheduler(ctx)
    link = SchedulerLink(ctx, scheduler.endpoint, "j", "test")
    ticks: list[float] = []
    assert link.register(Hello(role="worker"), lambda: False, lambda: None) is not None
    try:
        yield HeartbeatKeeper(link, lambda: ticks.append(time.monotonic())), scheduler, ticks
    finally:
        link.conn.sock.close(linger=0)
        scheduler.close()


def _answered(keeper: HeartbeatKeeper, scheduler: Scheduler, beats: int) -> None:
    """Wait until the scheduler took `beats` heartbeats and its answer to the last is in."""
    wait_for(f"{beats} heartbeats", lambda: len(scheduler.beats) >= beats, 10)
    wait_for("the answer", lambda: keeper.link.wait(0.05) is not None or keeper.link.lost, 10)


def test_it_repeats_the_last_heartbeat_and_is_due_again_an_interval_later(keeper):
    beat, scheduler, ticks = keeper
    beat.interval_s = 60.0
    report = Heartbeat(steps=2, samples=64, batch=32)
    beat.send(report)
    beat.when_due()  # sent just now: nothing
    beat.repeat()
    wait_for("two heartbeats", lambda: len(scheduler.beats) == 2, 10)
    assert [repr(b) for b in scheduler.beats] == [repr(report)] * 2 and len(ticks) == 1  # repr: NaN loss
    assert beat.next_at > time.monotonic() + 50


def test_a_rollback_ends_a_wait_only_once_the_process_trains(keeper):
    beat, scheduler, _ = keeper
    scheduler.answer = Assignment(assignment_id=1, rollbacks=1)
    beat.send(Heartbeat())
    _answered(beat, scheduler, 1)
    beat.repeat()  # an evaluator (rollbacks None) hears nothing of rollbacks
    beat.rollbacks = 1
    beat.repeat()  # the one it acted on already
    beat.rollbacks = 0
    with pytest.raises(RemoteError) as ended:
        beat.repeat()
    assert ended.value.code == "rolled_back"


def test_a_dropped_process_ends_its_wait_at_the_next_heartbeat_that_is_due(keeper):
    beat, scheduler, _ = keeper
    scheduler.answer = Error("unknown_sender", "who are you")
    beat.send(Heartbeat())
    _answered(beat, scheduler, 1)
    beat.next_at = 0.0
    with pytest.raises(RemoteError) as ended:
        beat.when_due()
    assert ended.value.code == "unknown_sender"
