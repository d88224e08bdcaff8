"""The parameter-server shard's socket loop: it receives, dispatches and replies; the decisions are made below it.

One ROUTER serves workers (INIT, PULL, PUSH); one DEALER keeps the shard registered with the scheduler, which answers
its heartbeats with the live worker set, the batches each may push, rollbacks and, at the end of the job, a stop.
Every received message is validated before it reaches the state; a bad one is answered with ERROR and counted, and
nothing that arrives on a socket can stop the loop. Who decides what: the job and what WELCOME fixes with it,
ServedJob (served_job.py); the model the first INIT (or the checkpoint) gives, HeldModel (held_model.py: ShardState,
TrainingSetup, shard 0's travelling buffers); a message in a live worker's name only from the connection that first
spoke for it (senders.py); pulls and pushes on the model, model_service.py (whether a PUSH is taken: the checks of
push_admission.py, in the order its `STEPS` declare; pulls that wait for their chunks: parked_pulls.py); what a peer
may cost, peer_limits.py and outbox.py; checkpoints, the model's health and rollbacks, good_checkpoint.py and
model_health.py; what the shard reports to the scheduler, shard_report.py.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Sequence
from typing import TypeVar

import torch
import zmq
from prometheus_client import CollectorRegistry

from dynabatch.common.net.curve import CurveKeys
from dynabatch.common.net.log_limit import RateLimitedLog
from dynabatch.common.net.metrics import ADDRESS_LOG, Health, MetricsServer, connection_reports, handshake_failures
from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import Incoming, RemoteError, bind_router, open_context, recv_waiting, reply_frames
from dynabatch.common.planning.protocol_switch import switch_to
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ChunkMeta, Message, ProtocolError
from dynabatch.common.wire.handlers import Handlers
from dynabatch.common.wire.member_ids import member_id
from dynabatch.common.wire.messages import Init, InitAck, Pull, Push, Role, ShardAssignment, ShardHeartbeat, Welcome
from dynabatch.ps.checkpoint import ForeignCheckpoint
from dynabatch.ps.good_checkpoint import GoodCheckpoint
from dynabatch.ps.held_model import HeldModel, init_setup
from dynabatch.ps.model_service import ModelService, switch_protocol, unrunnable
from dynabatch.ps.options import PsOptions
from dynabatch.ps.outbox import SEND_QUEUE, Outbox
from dynabatch.ps.peer_limits import UNMODELLED_BACKLOG, backlog_limit
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.senders import SenderBindings
from dynabatch.ps.serve_order import serve_key
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.serving_load import ServingLoad
from dynabatch.ps.shard_report import shard_heartbeat, shard_hello

log = logging.getLogger("dynabatch.ps")
MAX_BATCH_PER_POLL = 64


T = TypeVar("T")


def _present(value: T | None, missing: str) -> T:
    """`value`, which the shard's loop sets before any handler that reads it runs; RuntimeError(`missing`) if not."""
    if value is None:
        raise RuntimeError(missing)
    return value


class ShardServer:
    """One shard's conversation: registers with the scheduler, dispatches what arrives on its sockets in order,
    and replies. It owns the order of things, not the decisions (see the module's docstring)."""

    def __init__(self, opts: PsOptions, metrics_host: str, metrics_port: int, curve: CurveKeys | None) -> None:
        self.opts = opts
        self.registry = CollectorRegistry()
        self.health = Health()
        self.metrics_server = MetricsServer(self.registry, self.health, metrics_host, metrics_port)
        self.ctx = open_context(curve)
        self.sock, self.endpoint = bind_router(self.ctx, opts.bind, connection_reports(self.registry, "ps"), SEND_QUEUE)
        self.advertise = opts.advertise or self.endpoint.replace("0.0.0.0", socket.gethostname())
        self.name = opts.name or f"ps-{socket.gethostname()}"
        self.stopping = False
        self.refusals = RateLimitedLog(log)
        self.job_over = False
        self.beat_due = False  # report now, not at the next heartbeat: the scheduler waits on it (push_bounds.py)
        self.next_beat = 0.0  # when the next heartbeat is due (monotonic seconds)
        self.senders = SenderBindings()  # which connection speaks for each live worker (senders.py)
        self.replays = ReplayGuard()  # the PUSH seqs already taken, per sender and connection (replay_guard.py)
        self.outbox = Outbox(self.sock, UNMODELLED_BACKLOG, self._reply_dropped)  # (ps/outbox.py)
        self.membership = 0  # the scheduler's number of the live worker set the model follows
        self.served: ServedJob | None = None  # the job, once the scheduler has welcomed this shard (served_job.py)
        self.kept: GoodCheckpoint | None = None  # checkpoints and rollbacks of the job's model (good_checkpoint.py)
        self.serving: ModelService | None = None  # once the first INIT or a checkpoint gave the model (held_model.py)
        self.last_assignment: ShardAssignment | None = None
        self.load = ServingLoad()  # seconds serving pulls and pushes, and their wait (serving_load.py)
        failed = handshake_failures(self.registry)
        self.handlers = Handlers[bytes, None]("a shard")  # by message type, called with the sender's connection
        self.handlers.on(Init, self._on_init)
        self.handlers.on(Pull, lambda msg, identity: self.service.pull(msg, identity))
        self.handlers.on(Push, lambda msg, identity: self.service.push(msg, identity))
        self.link = SchedulerLink(
            self.ctx, opts.scheduler, opts.job, self.name, ShardHeartbeat, ShardAssignment, failed
        )
        torch.set_num_threads(opts.threads)

    @property
    def served_job(self) -> ServedJob:
        """The job the scheduler welcomed this shard to; set before the loop starts."""
        return _present(self.served, "this shard has not been welcomed to a job yet")

    @property
    def checkpoints(self) -> GoodCheckpoint:
        """This shard's checkpoints and rollbacks; set with the job, before the loop starts."""
        return _present(self.kept, "this shard has not been welcomed to a job yet")

    @property
    def service(self) -> ModelService:
        """Pulls and pushes on the model; a PULL or PUSH before the first INIT (or a checkpoint) set it is refused."""
        if self.serving is None:
            raise ProtocolError(ErrorCode.NOT_INITIALIZED, "no worker has sent this shard its model yet (INIT)")
        return self.serving

    @property
    def held(self) -> HeldModel | None:
        """The model, its set-up and buffers (held_model.py); None until the first INIT or a checkpoint."""
        return self.serving.held if self.serving is not None else None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ADDRESS_LOG.info(
            "listening on %s (advertised to workers as %s), metrics on %s",
            self.endpoint,
            self.advertise,
            self.metrics_server.url(),
        )
        welcome = self._register(self.opts.shard_index)
        if welcome is None:
            return 1
        try:
            self._setup(welcome)
        except ForeignCheckpoint as exc:
            log.error("%s", exc)
            self.link.bye()
            self.metrics_server.close()
            return 2
        try:
            self._loop()
        finally:
            self.checkpoints.write(self.held)
            self.link.bye()
            log.info("%s", self.served_job.defences_summary())
        if self.job_over and self.opts.on_finish == "idle":
            log.info("job finished; idling until stopped (--on-finish idle)")
            self.health.idle_until(lambda: self.stopping)
        self.metrics_server.close()
        return 0

    def _reply_dropped(self) -> None:
        """The outbox dropped a reply: its peer had left too many unread (only once the model is held)."""
        if self.served is not None:
            self.served.metrics.replies_dropped.inc()

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("signal %d: checkpointing and stopping", signum)
        self.stopping = True

    def _register(self, shard_index: int) -> Welcome | None:
        """Join the job (the scheduler may start after us, or restart)."""
        self.membership = 0  # a restarted scheduler numbers its worker sets afresh
        hello = shard_hello(shard_index, self.name, self.advertise, self.metrics_server.url())
        try:
            return self.link.register(hello, lambda: self.stopping, self.health.tick)
        except RemoteError as exc:
            log.error("scheduler refused this shard: %s", exc)
            return None

    def _setup(self, welcome: Welcome) -> None:
        """Take the job the scheduler welcomed this shard to, and resume its checkpoint if there is one."""
        served = self.served = ServedJob.welcomed(welcome, self.registry, self.opts.checkpoint_dir)
        kept = self.kept = GoodCheckpoint(served, self.opts.checkpoint_interval_s, self.replays)
        self.link.conn.job = served.name
        self.link.watch_contact(self.health, served.job.liveness_timeout_s)
        saved = served.load_checkpoint()
        if saved is not None:
            held = HeldModel.from_checkpoint(served, saved)
            self._hold(held)
            kept.resume(held, saved)
            log.info(
                "resumed from %s at version %d (%d samples); updates after it are lost, and the scheduler "
                "counts them back into the job",
                served.checkpoint_path,
                held.state.version,
                held.state.samples_seen,
            )
        else:
            log.info(
                "shard %d of %d at %s: waiting for the first worker's model",
                served.index,
                served.job.shards,
                self.advertise,
            )
            served.metrics.version.set(0)
        self.health.ready = True

    def _hold(self, held: HeldModel) -> None:
        """Serve `held` from now on, as the scheduler last described the job (if it did before the model came)."""
        served, sig = self.served_job, held.setup.signature
        self.serving = ModelService(
            served, held, self.checkpoints, self.replays, self.outbox, self._reply, self._beat, self.load
        )
        self.serving.export_version()
        self.beat_due |= unrunnable(served, self.serving.task_optimizer)
        self.checkpoints.health.judge_afresh(held.state, self.checkpoints.good_version)
        if self.last_assignment is not None:
            self.serving.follow(self.last_assignment)
        self.outbox.limit = backlog_limit(len(held.state.chunks))  # fewer replies per peer once the model is known
        log.info(
            "shard %d of %d ready at %s: %d chunks of a %d-parameter model (%d here), protocol %s, %s",
            *(served.index, served.job.shards, self.advertise, len(held.state.chunks), sig.total),
            *(sum(c.length for c in held.state.chunks), served.job.protocol, held.state.optimizer),
        )

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.conn.sock, zmq.POLLIN)
        self._beat()  # before serving anything: a resumed shard's first report is its checkpoint's version
        while not self.stopping and not self.job_over:
            self.outbox.flush()
            events = dict(poller.poll(timeout=self.outbox.poll_ms))
            if self.link.conn.sock in events:  # first: a worker told a new batch pushes it only after this shard was
                self._on_assignment(self.link.poll())
            if self.sock in events:
                received = time.perf_counter()
                pending = recv_waiting(self.sock, MAX_BATCH_PER_POLL, self.held.limits if self.held else None)
                ranks = self.last_assignment.serve_ranks if self.last_assignment is not None else {}
                rounds = protocol_spec(self.served_job.job.protocol).closes_rounds  # egress by rank (outbox.py)
                self.outbox.rank_by(self.senders.by_connection(ranks) if rounds else {})
                self.load.pushed_by(self.senders.pusher(i.message, i.identity, self.served_job.name) for i in pending)
                for incoming in sorted(pending, key=lambda i: serve_key(i, ranks)):
                    self._handle(incoming, received)
                    if time.monotonic() >= self.next_beat:  # a long batch (a busy shard) still reports on time
                        self._beat()
            now = time.monotonic()
            if now >= self.next_beat or self.beat_due:
                self._beat()
            if self.serving is not None:
                self.serving.close_overdue(now)
                self.serving.expire_parked(now)
            self.checkpoints.tick(now, self.held)
            self.health.tick()

    def _beat(self) -> None:
        """Report version and samples to the scheduler (a drop in them tells it this shard lost work).

        The answer to an earlier heartbeat may be taken here rather than by the loop's poll.
        """
        self.beat_due = False
        self.next_beat = time.monotonic() + self.served_job.job.heartbeat_s
        report = shard_heartbeat(
            self.served_job, self.checkpoints, self.held, self.membership, self.senders.live, self.load
        )
        self._on_assignment(self.link.heartbeat(report))

    def _on_assignment(self, body: ShardAssignment | None) -> None:
        if self.link.lost:
            log.warning("scheduler no longer knows this shard (restarted?); registering again")
            self._register(self.served_job.index)
            return
        if body is None:
            return
        self.last_assignment = body
        self.membership = body.membership
        serving = self.serving
        if self.checkpoints.rollback_due(body, holds_model=serving is not None):
            self.service.roll_back(body)
            # Report the drop in version before serving another push, so that the scheduler counts the updates
            # thrown away back into the job; the heartbeat's answer (the newest assignment) is handled in full.
            self._beat()
            return
        self.senders.set_live(set(body.live_workers))
        ordered = switch_to(body.protocol, self.served_job.job.protocol)
        if ordered is not None:
            self.beat_due |= switch_protocol(self.served_job, serving, ordered)
        if self.served_job.follow(body):
            self.beat_due = True  # a worker waits for this shard to report its larger bound before it gets it
        if serving is not None:
            serving.follow(body)
        if body.stop:
            log.info("job finished")
            self.job_over = True

    def _handle(self, incoming: Incoming, received: float) -> None:
        if incoming.error is not None:
            return self._reject(incoming, incoming.error)
        msg = incoming.decoded
        start = time.perf_counter()
        try:
            if msg.job != self.served_job.name:
                raise ProtocolError(
                    ErrorCode.WRONG_JOB, f"this shard serves job {self.served_job.name!r}, not {msg.job!r}", msg.seq
                )
            self.senders.check_message(msg, incoming.identity, incoming.key_role)
            self.handlers.handle(msg, incoming.identity)
        except ProtocolError as exc:
            exc.ref = msg.seq
            self._reject(incoming, exc)
        except Exception as exc:  # a bug must cost one message, never the shard
            log.exception("internal error handling %s from %s", msg.type, msg.sender)
            self._reject(incoming, ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", msg.seq))
        self.served_job.metrics.handle.labels(self.served_job.label, msg.type).observe(time.perf_counter() - start)
        self.load.served(msg.type, received, start, time.perf_counter())

    def _reject(self, incoming: Incoming, error: ProtocolError) -> None:
        self.served_job.metrics.bad.labels("ps", error.code).inc()
        self.refusals.refused(error.code, str(error))
        self._reply(incoming.identity, error.to_error(), error.ref)

    def _reply(
        self,
        identity: bytes,
        body: object,
        seq: int,
        metas: Sequence[ChunkMeta] = (),
        tensors: Sequence[torch.Tensor | memoryview] = (),
    ) -> None:
        served = self.served_job
        self.outbox.send(
            identity, reply_frames(body, seq, served.name, member_id(Role.SHARD, served.index), metas, tensors)
        )

    def _on_init(self, msg: Message[Init], identity: bytes) -> None:
        """The first INIT sets the model; every later one must describe the same model."""
        setup = init_setup(self.served_job.job, msg.body)
        if self.held is not None:
            difference = self.held.setup.difference(setup)
            if difference is not None:
                raise ProtocolError(ErrorCode.SIGNATURE, f"this model differs from the job's: {difference}")
            self._reply(identity, InitAck(self.held.state.version), msg.seq)
            return
        self._hold(HeldModel.from_init(self.served_job, setup, msg))
        self.checkpoints.write(self.held)  # a shard killed before its first interval checkpoint resumes this model
        log.info("initialised by %s: %d parameters", msg.sender, setup.signature.total)
        self._reply(identity, InitAck(0, initialized=True), msg.seq)
