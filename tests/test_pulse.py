"""The liveness thread (worker/pulse.py) and the link's repeat (`SchedulerLink.repeat_if_quiet`), against a
ROUTER socket in this process that answers HELLO as the scheduler does (scheduler_socket.py).
"""

from __future__ import annotations

import time

import zmq

from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import Error, Hello, Role, WorkerAssignment, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.worker.pulse import Pulse
from harness import wait_for
from scheduler_socket import SchedulerSocket

INTERVAL_S = 0.05


def _seen_as(messages: list[tuple[str, object]]) -> list[str]:
    """Messages as comparable text (a heartbeat's loss is NaN until a step, and NaN equals nothing)."""
    return [repr(m) for m in messages]


def _seen(router: SchedulerSocket) -> list[str]:
    return _seen_as(list(router.got))


def _register(link: SchedulerLink[WorkerHeartbeat, WorkerAssignment]) -> None:
    assert link.register(Hello(role=Role.WORKER), lambda: False, lambda: None) is not None


def test_the_link_repeats_exactly_its_last_heartbeat_and_none_of_an_old_registration() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = SchedulerSocket(ctx)
    link = SchedulerLink(ctx, router.endpoint, "j", "test", WorkerHeartbeat, WorkerAssignment)
    try:
        assert not link.repeat_if_quiet(0.0), "unregistered: nothing to keep alive"
        _register(link)
        assert link.repeat_if_quiet(0.0), "registered, nothing sent yet: an empty heartbeat"
        report = WorkerHeartbeat(steps=3, samples=96, batch=32, times=StepTimes(step_s=0.5), standalone_sps=100.0)
        link.heartbeat(report)
        assert not link.repeat_if_quiet(60.0), "a heartbeat went just now"
        assert link.repeat_if_quiet(0.0)
        wait_for("three heartbeats", lambda: len(router.got) >= 3, 10)
        assert _seen(router) == _seen_as([("w0", WorkerHeartbeat()), ("w0", report), ("w0", report)])

        link.lost = True
        assert not link.repeat_if_quiet(0.0), "forgotten by the scheduler: registering again is the main thread's"
        _register(link)
        assert link.repeat_if_quiet(0.0)
        wait_for("the repeat", lambda: len(router.got) == 4, 10)
        assert _seen(router)[3:] == _seen_as([("w1", WorkerHeartbeat())]), "the new member repeats no old counters"
    finally:
        link.close()
        router.close()


def test_the_pulse_heartbeats_while_the_main_thread_is_silent_and_not_after_it_stops() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = SchedulerSocket(ctx)
    link = SchedulerLink(ctx, router.endpoint, "j", "test", WorkerHeartbeat, WorkerAssignment)
    try:
        _register(link)
        report = WorkerHeartbeat(steps=1, samples=32, batch=32, times=StepTimes(step_s=0.5), standalone_sps=100.0)
        link.heartbeat(report)
        pulse = Pulse(link, INTERVAL_S).start()
        wait_for("five repeats", lambda: len(router.got) >= 6, 10)
        pulse.stop()
        assert set(_seen(router)) == set(_seen_as([("w0", report)]))
        link.heartbeat(
            WorkerHeartbeat(steps=2, samples=64, batch=32, times=StepTimes(step_s=0.5), standalone_sps=100.0)
        )
        wait_for(
            "the main thread's next heartbeat",
            lambda: isinstance(beat := router.got[-1][1], WorkerHeartbeat) and beat.steps == 2,
            10,
        )
        sent = len(router.got)
        time.sleep(5 * INTERVAL_S)  # a window to see nothing in, not a wait for something
        assert len(router.got) == sent, "stopped: it repeats nothing more"
    finally:
        link.close()
        router.close()


def test_the_pulse_ends_a_process_whose_main_thread_does_not_register_again_after_the_scheduler_forgot_it() -> None:
    """The scheduler dropped it for making no progress (or restarted): a main thread that lives registers again;
    one that has not within `wedged_after_s` hangs, and the pulse calls `on_wedged` (in a process: exit 1)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = SchedulerSocket(ctx)
    link = SchedulerLink(ctx, router.endpoint, "j", "test", WorkerHeartbeat, WorkerAssignment)
    wedged: list[float] = []
    try:
        _register(link)
        link.heartbeat(WorkerHeartbeat())
        pulse = Pulse(link, INTERVAL_S, 20 * INTERVAL_S, lambda: wedged.append(time.monotonic())).start()
        router.answer = Error(code=ErrorCode.UNKNOWN_SENDER, text="the scheduler does not know w0")
        wait_for("the pulse to hear it was forgotten", lambda: link.lost_at is not None, 10)
        lost_at = link.lost_at
        assert lost_at is not None
        wait_for("the pulse to give the main thread up", lambda: wedged, 10)
        assert wedged[0] - lost_at >= 20 * INTERVAL_S
        pulse.stop()
        _register(link)
        assert link.lost_at is None and not link.lost, "registered again: nothing hangs"
    finally:
        link.close()
        router.close()
