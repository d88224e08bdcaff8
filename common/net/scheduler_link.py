"""A process's link to the scheduler: register, heartbeat, follow assignments.

Shared by shards, workers and evaluators. Registration retries until the
scheduler is up and ready (it may start after us, or wait for its shards);
heartbeats are fire-and-forget and the latest ASSIGNMENT wins. If the
scheduler goes away the process keeps its last assignment, and says so
(scheduler_contact.py); if it comes back without knowing us (restart), `lost`
is set and the caller registers again. A scheduler that refuses our keys is
told apart from an absent one by the handshake's failure (ZeroMQ's monitor).

A worker's liveness thread (worker/pulse.py) sends on the same socket, which
is why every use of it holds `_lock`: ZeroMQ sockets are not thread-safe, but
a socket may pass between threads across a full memory barrier, which a lock
is. The thread only repeats the last heartbeat this link sent (`repeat_if_quiet`),
so its counters never differ from what the main thread reported.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Generic

import zmq

from dynabatch.common.net.metrics import Health
from dynabatch.common.net.scheduler_contact import SchedulerContact
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import (
    Answer,
    Bye,
    Error,
    Hello,
    Report,
    Welcome,
)

log = logging.getLogger("dynabatch.link")
# The job is not up yet; a restarted shard's old self is not yet dead; this machine registered many members at once.
RETRYABLE = (ErrorCode.NOT_READY, ErrorCode.SLOT_TAKEN, ErrorCode.HELLO_RATE, ErrorCode.FULL)
"""HELLO refusals a process waits out, asking again: each passes (the shards register, an old slot is freed, the
rate allows, a member leaves a full job: the one past --max-workers waits as a spare)."""
BYE_TIMEOUT_S = 5.0  # a scheduler that is gone must not hold up a process's exit for long
BYE_ATTEMPT_S = 1.0
ASK_EVERY_S = 0.05  # between two heartbeats of a process that waits on the scheduler (`ask`)
LATE_INTERVALS = 5  # heartbeat intervals without one after which the liveness thread says it was held up


class SchedulerLink(Generic[Report, Answer]):
    """DEALER to the scheduler plus the registration and assignment protocol, for a role that heartbeats with
    `Report` and is answered with `Answer`: a worker's or evaluator's (WorkerHeartbeat, WorkerAssignment) or a
    shard's (ShardHeartbeat, ShardAssignment)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        job: str,
        name: str,
        report: type[Report],
        answer: type[Answer],
        handshake_failed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """`handshake_failed` is told the reason of each failed handshake (metrics.handshake_failures)."""
        self.report: type[Report] = report
        self.answer: type[Answer] = answer
        self.conn = Connection(ctx, endpoint, job, name)
        self.conn.handshake_failed = handshake_failed
        # A BYE gives up at once on a scheduler whose connection closed (`bye`); the contact (`watch_contact`)
        # hears of it; a refused key is told apart from an absent scheduler (`register`).
        self.conn.watch_drops(handshakes=True)
        self.contact: SchedulerContact | None = None
        self.instance = secrets.token_hex(8)  # makes a repeated HELLO of ours harmless (see Hello)
        self.assignment: Answer | None = None
        self.refused: Error | None = None  # the scheduler's answer to our last report, where it refused it
        self.lost = False
        self.lost_at: float | None = None  # when an answer said the scheduler does not know us (`lost`)
        self.id = ""
        self._lock = threading.RLock()
        self._last: Report | None = None  # the last heartbeat sent by this registration
        self._sent_at = 0.0

    def register(self, hello: Hello, should_stop: Callable[[], bool], on_wait: Callable[[], None]) -> Welcome | None:
        """HELLO until WELCOME; None if asked to stop first. Raises RemoteError if refused for good."""
        hello = replace(hello, instance=self.instance)
        self.conn.sender = hello.name
        self.lost_at = None  # the main thread has taken it up: it does not hang (worker/pulse.py)
        waited_for = ""
        while not should_stop():
            reason = "unexpected answer to HELLO"
            with self._lock:
                try:
                    reply = self.conn.request(hello, timeout_s=2.0)
                except TimeoutError:
                    reply = None
                    reason = self._why_unanswered()
                except RemoteError as exc:
                    if exc.code not in RETRYABLE:
                        raise
                    reply = None
                    reason = f"{exc.code}: {exc.text}"
                    self.conn.recv(1.0)
                if reply is not None and isinstance(reply.body, Welcome):
                    self.id = reply.body.id
                    self.conn.sender = self.id
                    self.lost, self.lost_at = False, None
                    self._last, self._sent_at = None, 0.0  # a new member: the old counters are not its own,
                    self.assignment = None  # nor the old assignment (its allotment counts the old member's samples)
                    if self.contact is not None:
                        self.contact.heard(time.monotonic())
                    return reply.body
            if reason != waited_for:
                log.info("waiting: %s", reason)
                waited_for = reason
            on_wait()
        return None

    def _why_unanswered(self) -> str:
        """Why a HELLO went unanswered: the handshake failed (keys), or no scheduler there (or not yet)."""
        self.conn.note_drops()
        if self.conn.refused:
            return (
                f"the scheduler at {self.conn.endpoint} refuses this process's handshake ({self.conn.refused}): "
                "its CURVE keys do not match this process's (--curve-dir: a folder of another `dynabatch keys`, "
                "or CURVE on one side only)"
            )
        return f"no answer from the scheduler at {self.conn.endpoint}"

    def watch_contact(self, health: Health, silence_s: float) -> None:
        """From now on, say when the scheduler is lost and back (scheduler_contact.py); `silence_s` is the longest a
        live scheduler leaves heartbeats unanswered."""
        if self.contact is None:
            self.contact = SchedulerContact(self.conn.endpoint, health, silence_s, time.monotonic())

    def heartbeat(self, hb: Report) -> Answer | None:
        """Send `hb` (fire-and-forget); returns the newest assignment, as `poll`."""
        with self._lock:
            if self.conn.send(hb) < 0:
                log.warning("a heartbeat was not sent: the scheduler's connection is not writable (its queue is full)")
            self._last, self._sent_at = hb, time.monotonic()
            assignment = self.poll()
            if self.contact is not None:
                self.contact.check(self._sent_at, self.conn.down)
            return assignment

    def repeat_if_quiet(self, interval_s: float) -> bool:
        """Send the last heartbeat again (an empty one if none was sent yet) if none went for `interval_s`;
        True if one was sent.

        The counters are cumulative, so a repeat counts nothing twice and claims
        no progress. Nothing is sent while unregistered or forgotten (`lost`):
        the scheduler would refuse it, and registering again is the main thread's.
        """
        with self._lock:
            quiet_s = time.monotonic() - self._sent_at
            if not self.id or self.lost or quiet_s < interval_s:
                return False
            if self._sent_at and quiet_s > LATE_INTERVALS * interval_s:
                log.warning(
                    "no heartbeat went for %.1f s (one is due every %.1f s): this process had no CPU, or its main "
                    "thread held the scheduler's socket that long; the scheduler drops a member after its liveness "
                    "timeout",
                    quiet_s,
                    interval_s,
                )
            self.heartbeat(self._last or self.report())
            return True

    def ask(self, hb: Report) -> Answer | None:
        """For a process that waits on the scheduler (for a batch, for the job's stop): heartbeat `hb` unless one
        went less than ASK_EVERY_S ago, then take answers until the next is due; returns the newest assignment.

        The scheduler answers each heartbeat at once, so a loop that sent one and waited for any answer sent the
        next a millisecond later: an evaluator between evaluations, or a worker waiting for its first batch (or
        left out with batch 0), kept the scheduler answering hundreds of heartbeats a second, a third of a
        short job's CPU."""
        if time.monotonic() - self._sent_at >= ASK_EVERY_S:
            self.heartbeat(hb)
        return self.wait(max(0.0, self._sent_at + ASK_EVERY_S - time.monotonic()))

    def send(self, body: object) -> None:
        """Send any other report (fire-and-forget), in turn with the liveness thread."""
        with self._lock:
            self.conn.send(body)

    def poll(self) -> Answer | None:
        """Take every waiting answer; returns the newest assignment (or the last one kept)."""
        with self._lock:
            for msg in self.conn.drain():
                self._take(msg.body)
            return self.assignment

    def wait(self, timeout_s: float) -> Answer | None:
        """Block up to `timeout_s` for the next answer, then take all waiting ones."""
        with self._lock:
            msg = self.conn.recv(timeout_s)
            if msg is not None:
                self._take(msg.body)
            return self.poll()

    def _take(self, body: object) -> None:
        if self.contact is not None:
            self.contact.heard(time.monotonic())
        if isinstance(body, self.answer):
            self.assignment, self.refused = body, None
        elif isinstance(body, Error):
            if body.code in (ErrorCode.UNKNOWN_SENDER, ErrorCode.BAD_SENDER):  # forgotten, or our connection replaced
                if not self.lost:
                    self.lost, self.lost_at = True, time.monotonic()
            else:
                self.refused = body
                log.warning("scheduler answered ERROR %s: %s", body.code, body.text)

    def bye(self, timeout_s: float = BYE_TIMEOUT_S) -> bool:
        """Leave, and wait until the scheduler has taken everything sent so far; False if it never answered.

        A scheduler whose connection closed and did not come back within one attempt is gone (its process ended,
        as when `dynabatch run` ends after the scheduler failed): nothing is left to wait for.
        """
        if not self.id:
            return True  # never registered: the scheduler holds nothing of ours
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                with self._lock:
                    self.conn.request(Bye(), timeout_s=min(BYE_ATTEMPT_S, left))
                return True
            except TimeoutError:
                with self._lock:
                    self.conn.note_drops()
                if self.conn.down:
                    log.warning(
                        "scheduler at %s is unreachable (its connection closed); leaving without its "
                        "acknowledgement: its counts of this process may be short",
                        self.conn.endpoint,
                    )
                    return False
                continue
            except RemoteError as exc:  # e.g. it had already dropped us: nothing left to deliver
                log.info("scheduler answered BYE with %s: %s", exc.code, exc.text)
                return True
        log.warning(
            "scheduler at %s did not acknowledge BYE within %.0fs; its counts of this process may be short",
            self.conn.endpoint,
            timeout_s,
        )
        return False

    def close(self) -> None:
        self.conn.close()
