"""A thread that keeps the scheduler's liveness clock fed while the worker's main thread is busy.

Between its WELCOME and its BYE a worker is silent whenever its main thread
computes: loading the data and building the model, the first step (a new batch
shape's kernels), any step of a big model on a slow CPU. Heartbeats sent from the
main thread between steps cannot cover a single call that outlasts the liveness
timeout, and an honest but slow worker would be dropped from n, its pushes refused,
and registered again under a new id. This thread repeats the last heartbeat
whenever none went for one heartbeat interval, so the scheduler can expire a
member that registered and never heartbeats within its liveness timeout, and
still never drop a process that is alive.

It shares the main thread's scheduler socket through SchedulerLink's lock (a
second socket would be another connection, which the scheduler refuses in the
member's name), and it repeats counters, never reports progress: a worker is
counted in n only once the main thread has reported its measured speed.

The scheduler drops a process whose main thread makes no progress (a step, an
evaluation) while this thread beats. A main thread that lives registers again
within a heartbeat of hearing it; one that has not after `wedged_after_s` (the
job's join timeout, the longest any step may take) hangs, and the process exits
with an error so that `dynabatch run` (or Kubernetes) starts it afresh.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import zmq

from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.wire.messages import WorkerAssignment, WorkerHeartbeat

log = logging.getLogger("dynabatch.worker")
WEDGED_EXIT = 1  # an error: `dynabatch run` restarts the process (cluster/restart_policy.py)


def exit_wedged() -> None:
    """End a process whose main thread hangs: from this thread only the whole process can end (its logs flushed;
    the scheduler has already dropped it, so there is no BYE to send)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(WEDGED_EXIT)


class Pulse:
    """Repeats `link`'s last heartbeat whenever none went for `interval_s`, from start() until stop(); calls
    `on_wedged` once the scheduler has forgotten the process for `wedged_after_s` without the main thread
    registering again."""

    def __init__(
        self,
        link: SchedulerLink[WorkerHeartbeat, WorkerAssignment],
        interval_s: float,
        wedged_after_s: float = float("inf"),
        on_wedged: Callable[[], None] = exit_wedged,
    ) -> None:
        self.link = link
        self.interval_s = interval_s
        self.wedged_after_s = wedged_after_s
        self.on_wedged = on_wedged
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pulse", daemon=True)

    def start(self) -> Pulse:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and wait for the thread, so that the main thread has the socket to itself (BYE, closing)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s / 4):
            try:
                self.link.repeat_if_quiet(self.interval_s)
            except zmq.ZMQError as exc:  # the context is going away under a process that is ending
                log.warning("liveness heartbeats stopped: %s", exc)
                return
            lost_at = self.link.lost_at
            if lost_at is not None and time.monotonic() - lost_at > self.wedged_after_s:
                log.error(
                    "the scheduler dropped this process %.0f s ago and its main thread has not registered "
                    "again: it hangs (`kill -USR1 PID` would have written its stack); exiting with an error, "
                    "to be started afresh",
                    time.monotonic() - lost_at,
                )
                self.on_wedged()
                return
