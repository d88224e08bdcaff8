"""A thread that keeps the scheduler's liveness clock fed while the worker's main thread is busy.

Between its WELCOME and its BYE a worker is silent whenever its main thread
computes: loading the data and building the model, the first step (a new batch
shape's kernels), any step of a big model on a slow CPU. Heartbeats sent from the
main thread between steps cannot cover a single call that outlasts the liveness
timeout, so an honest but slow worker was dropped from n, its pushes refused,
and it registered again under a new id. This thread repeats the last heartbeat
whenever none went for one heartbeat interval, so the scheduler can expire a
member that registered and never heartbeats within its liveness timeout, and
still never drop a process that is alive.

It shares the main thread's scheduler socket through SchedulerLink's lock (a
second socket would be another connection, which the scheduler refuses in the
member's name), and it repeats counters, never reports progress: a worker is
counted in n only once the main thread has reported its measured speed.
"""

from __future__ import annotations

import logging
import threading

import zmq

from dynabatch.common.scheduler_link import SchedulerLink

log = logging.getLogger("dynabatch.worker")


class Pulse:
    """Repeats `link`'s last heartbeat whenever none went for `interval_s`, from start() until stop()."""

    def __init__(self, link: SchedulerLink, interval_s: float) -> None:
        self.link = link
        self.interval_s = interval_s
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
