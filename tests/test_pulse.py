"""The liveness thread (worker/pulse.py) and the link's repeat (`SchedulerLink.repeat_if_quiet`), against a
ROUTER socket in this process that answers HELLO as the scheduler does: what goes on the wire is read there.
"""

from __future__ import annotations

import threading
import time

import zmq

from dynabatch.common.messages import Heartbeat, Hello, Welcome
from dynabatch.common.scheduler_link import SchedulerLink
from dynabatch.common.transport import recv_routed, send_routed
from dynabatch.worker.pulse import Pulse
from harness import free_port, wait_for

INTERVAL_S = 0.05


class Router:
    """A ROUTER, on a thread of its own, that welcomes every HELLO as member `w<n>` and keeps every other
    message it gets as (sender, body)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)
        self.got: list[tuple[str, object]] = []
        self.welcomed = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            if not self.sock.poll(10):
                continue
            msg = recv_routed(self.sock)
            assert msg.message is not None, msg.error
            if isinstance(msg.message.body, Hello):
                welcome = Welcome(id=f"w{self.welcomed}", config={}, shards=[])
                send_routed(self.sock, msg.identity, welcome, msg.message.seq, "j", "scheduler")
                self.welcomed += 1
            else:
                self.got.append((msg.message.sender, msg.message.body))

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        self.sock.close(linger=0)


def _seen_as(messages: list[tuple[str, object]]) -> list[str]:
    """Messages as comparable text (a heartbeat's loss is NaN until a step, and NaN equals nothing)."""
    return [repr(m) for m in messages]


def _seen(router: Router) -> list[str]:
    return _seen_as(list(router.got))


def _register(link: SchedulerLink) -> None:
    assert link.register(Hello(role="worker"), lambda: False, lambda: None) is not None


def test_the_link_repeats_exactly_its_last_heartbeat_and_none_of_an_old_registration():
    ctx = zmq.Context.instance()
    router = Router(ctx)
    link = SchedulerLink(ctx, router.endpoint, "j", "test")
    try:
        assert not link.repeat_if_quiet(0.0), "unregistered: nothing to keep alive"
        _register(link)
        assert link.repeat_if_quiet(0.0), "registered, nothing sent yet: an empty heartbeat"
        report = Heartbeat(steps=3, samples=96, batch=32, step_s=0.5, standalone_sps=100.0)
        link.heartbeat(report)
        assert not link.repeat_if_quiet(60.0), "a heartbeat went just now"
        assert link.repeat_if_quiet(0.0)
        wait_for("three heartbeats", lambda: len(router.got) >= 3, 10)
        assert _seen(router) == _seen_as([("w0", Heartbeat()), ("w0", report), ("w0", report)])

        link.lost = True
        assert not link.repeat_if_quiet(0.0), "forgotten by the scheduler: registering again is the main thread's"
        _register(link)
        assert link.repeat_if_quiet(0.0)
        wait_for("the repeat", lambda: len(router.got) == 4, 10)
        assert _seen(router)[3:] == _seen_as([("w1", Heartbeat())]), "the new member repeats no old counters"
    finally:
        link.close()
        router.close()


def test_the_pulse_heartbeats_while_the_main_thread_is_silent_and_not_after_it_stops():
    ctx = zmq.Context.instance()
    router = Router(ctx)
    link = SchedulerLink(ctx, router.endpoint, "j", "test")
    try:
        _register(link)
        report = Heartbeat(steps=1, samples=32, batch=32, step_s=0.5, standalone_sps=100.0)
        link.heartbeat(report)
        pulse = Pulse(link, INTERVAL_S).start()
        wait_for("five repeats", lambda: len(router.got) >= 6, 10)
        pulse.stop()
        assert set(_seen(router)) == set(_seen_as([("w0", report)]))
        link.heartbeat(Heartbeat(steps=2, samples=64, batch=32, step_s=0.5, standalone_sps=100.0))
        wait_for("the main thread's next heartbeat", lambda: router.got[-1][1].steps == 2, 10)
        sent = len(router.got)
        time.sleep(5 * INTERVAL_S)  # a window to see nothing in, not a wait for something
        assert len(router.got) == sent, "stopped: it repeats nothing more"
    finally:
        link.close()
        router.close()
