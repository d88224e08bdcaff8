"""What a worker process and an evaluator process share, before, during and after a job.

Both are a named process with a ZeroMQ context, a device, a metrics server and
health, and a link to the scheduler; both register (again, when the scheduler
forgot them), keep a pulse while they load or compute, and leave with BYE. What
they do once joined differs: the trainer (trainer.py) trains, the evaluator
(evaluator.py) evaluates; each holds one `RoleProcess` for the rest.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from dynabatch.common.config import job_from_dict
from dynabatch.common.net.curve import CurveKeys
from dynabatch.common.net.metrics import Health, MetricsServer, handshake_failures
from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import RemoteError, open_context
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.wire.messages import Hello, Role, WorkerAssignment, WorkerHeartbeat
from dynabatch.worker.heartbeats import HeartbeatKeeper, Stopping
from dynabatch.worker.joined import Joined
from dynabatch.worker.options import WorkerOptions
from dynabatch.worker.pulse import Pulse

log = logging.getLogger("dynabatch.worker")


class RoleProcess:
    """One worker or evaluator process's plumbing: sockets, metrics, signals, registration and heartbeats.

    `role` is a worker's or an evaluator's, as the scheduler and the shards' key checks know it.
    """

    def __init__(
        self, opts: WorkerOptions, role: Role, metrics_host: str, metrics_port: int, curve: CurveKeys | None
    ) -> None:
        self.opts = opts
        self.role = role
        self.name = opts.name or f"{socket.gethostname()}-{os.getpid()}"
        self.ctx = open_context(curve)
        self.device = torch.device(opts.device)
        self.registry = CollectorRegistry()
        self.health = Health()
        self.metrics_server = MetricsServer(self.registry, self.health, metrics_host, metrics_port)
        log.info("metrics on %s", self.metrics_server.url())
        failed = handshake_failures(self.registry)
        self.link = SchedulerLink(
            self.ctx, opts.scheduler, opts.job, self.name, WorkerHeartbeat, WorkerAssignment, failed
        )
        self.beat = HeartbeatKeeper(self.link, self.health.tick, lambda: self.stopping)
        self.stopping = False
        self.pulse: Pulse | None = None
        torch.set_num_threads(opts.threads)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def join(self) -> Joined | None:
        """Register, then load the task, data and model for the job the scheduler runs and hand the model to
        its shards (INIT). None if the process was stopped before the scheduler answered."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        welcome = self.link.register(self._hello(), lambda: self.stopping, self.health.tick)
        if welcome is None:
            return None
        job = job_from_dict(welcome.config)
        self.link.conn.job = job.job
        self.beat.interval_s = job.heartbeat_s
        self.link.watch_contact(self.health, job.liveness_timeout_s)
        # Loading data and the model can take long; a main thread that hangs ends the process (pulse.py).
        self.pulse = Pulse(self.link, job.heartbeat_s, job.join_timeout_s).start()
        joined = Joined.welcomed(welcome, job, self.opts, self.ctx, self.device, self.beat.repeat)
        initialized = joined.init_shards(self.opts.request_timeout_s)
        # The device is read off the model's parameters, not the flag: the log says where the model really is.
        log.info(
            "%s joined job %r as %s: %s, %d parameters, %d training samples, %d shard(s)%s, slowdown %s, "
            "parameters on %s",
            self.name,
            job.job,
            joined.id,
            joined.task.name,
            joined.signature.total,
            joined.signature.train_size,
            len(welcome.shards),
            " (initialised them)" if initialized else "",
            self.opts.slowdown,
            next(joined.model.parameters()).device,
        )
        return joined

    def _hello(self) -> Hello:
        worker = self.role == Role.WORKER
        return Hello(
            role=self.role,
            host=socket.gethostname(),
            metrics_url=self.metrics_server.url(),
            name=self.name,
            max_batch=self.opts.max_batch if worker else 0,
            slowdown=Slowdown.parse(self.opts.slowdown).label() if worker else "",
        )

    def register_again(self, joined: Joined) -> bool:
        """The scheduler forgot this process (it restarted, or dropped it): register anew, under a new id.

        False if the process is stopping or the scheduler refuses it for good
        (`job_over`: the job finished meanwhile).
        """
        log.warning("%s: the scheduler does not know this %s any more; registering again", joined.id, self.role)
        try:
            if self.link.register(self._hello(), lambda: self.stopping, self.health.tick) is None:
                return False
        except RemoteError as exc:
            log.warning("%s cannot register again: %s", joined.id, exc)
            return False
        joined.rename(self.link.id)
        return True

    def serve(self, work: Callable[[Joined], object]) -> int:
        """Join the job, do `work` with what joining brought (train or evaluate), and leave however it ends;
        the process's exit status (0: the job ended, or the process was stopped before it joined)."""
        try:
            joined = self.join()
            if joined is None:
                return 0
            work(joined)
        except Stopping as exc:
            log.info("%s %s", self.name, exc)
        finally:
            self.leave()
        self.after_job()
        return 0

    def leave(self) -> None:
        """Stop the pulse (the socket is the main thread's again), then BYE."""
        if self.pulse is not None:
            self.pulse.stop()
        self.link.bye()

    def after_job(self) -> None:
        """With --on-finish idle, a job that ended (rather than a signal) leaves the process up."""
        if self.opts.on_finish == "idle" and not self.stopping:
            log.info("job finished; idling until stopped (--on-finish idle)")
            self.health.idle_until(lambda: self.stopping)
        self.metrics_server.close()
