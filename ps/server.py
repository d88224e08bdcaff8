"""The parameter-server shard's socket loop: it receives, dispatches and replies; the decisions are made below it.

What the parameters become, the protocol's rounds and the learning-rate schedule
are the ShardState's (shard_state.py, protocol_rules.py, step_size.py); the job
and what is fixed with it at WELCOME the ServedJob's (served_job.py); the model,
optimizer and schedule the first INIT names the TrainingSetup's (training_setup.py).

One ROUTER serves workers (PULL, PUSH); one DEALER keeps the shard registered
with the scheduler, which answers its heartbeats with the live worker set and,
at the end of the job, a stop. Every received message is validated before it
reaches the state; a bad one is answered with ERROR and counted, and nothing
that arrives on a socket can stop the loop. A message in a live worker's name is
taken only from the connection that first spoke for it (senders.py), a push's
numbers only within what its worker was told (push_bounds.py), each push only
once (replay_guard.py), its size only within the job's typical norms
(gradient_bounds.py), its sender only while its pushes do not keep opposing most
other workers' (gradient_direction.py), and once the model is held no message,
parked pull or reply queue may outgrow what the model needs (peer_limits.py).
Shard 0 also holds the model's travelling buffers (BatchNorm's running statistics; shared_buffers.py), which
ride on pushes and pulls as one extra chunk entry and never reach the update rules.
The shard watches its own parameters after every update and restore (param_guard.py):
it checkpoints only a healthy model, reports a sick one to the scheduler, and rolls
back to its last good checkpoint when the scheduler says so (ASSIGNMENT.rollbacks).
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import zmq
from prometheus_client import CollectorRegistry, Counter

from dynabatch.common.atomic_file import out_of_descriptors
from dynabatch.common.chunking import BUFFERS_ID
from dynabatch.common.curve import CurveKeys
from dynabatch.common.error_codes import ErrorCode
from dynabatch.common.key_roles import check_key_role
from dynabatch.common.log_limit import RateLimitedLog
from dynabatch.common.messages import Assignment, Heartbeat, Hello, Init, InitAck, Params, Pull, Push, PushAck, Welcome
from dynabatch.common.metrics import ADDRESS_LOG, Health, MetricsServer, connection_reports, handshake_failures
from dynabatch.common.model_signature import ModelSignature
from dynabatch.common.scheduler_link import SchedulerLink
from dynabatch.common.transport import Incoming, RemoteError, bind_router, open_context, recv_routed, reply_frames
from dynabatch.common.wire import ChunkMeta, Message, ProtocolError, WireLimits, check_chunks, check_finite
from dynabatch.ps.checkpoint import ForeignCheckpoint
from dynabatch.ps.gradient_bounds import QUARANTINE_AFTER, Assessment
from dynabatch.ps.options import PsOptions
from dynabatch.ps.outbox import SEND_QUEUE, Outbox
from dynabatch.ps.param_guard import ParamGuard
from dynabatch.ps.peer_limits import MAX_PARKED_PER_PEER, UNMODELLED_BACKLOG, backlog_limit, wire_limits
from dynabatch.ps.push_bounds import check_push_numbers, check_push_samples
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.senders import SenderBindings
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ShardState, StaleGradient
from dynabatch.ps.shared_buffers import SharedBuffers
from dynabatch.ps.training_setup import TrainingSetup
from dynabatch.ps.update_rules import optimizer_spec

log = logging.getLogger("dynabatch.ps")
MAX_BATCH_PER_POLL = 64


@dataclass
class ParkedPull:
    """A pull waiting for chunks to reach `min_version` (a synchronous round), or for its
    worker to be let through (ssp: too far ahead of the slowest). Each chunk is sent the
    moment it is due, so the front of the model is not held up by the back."""

    identity: bytes
    seq: int
    worker: str
    remaining: list[int]
    min_version: int
    deadline: float
    buffers: bool = False  # the travelling buffers are still to be sent, with the next chunk


def priority(incoming: Incoming) -> int:
    """Lower is served first: the smallest chunk id a message touches (front of the model first)."""
    msg = incoming.message
    if msg is None:
        return -1
    if msg.chunks:
        return min(c.id for c in msg.chunks)
    ids = getattr(msg.body, "ids", None)
    return min(ids) if ids else 0


def message_of(incoming: Incoming) -> Message:
    """The message of an `incoming` whose error has been dealt with (one without an error always has one)."""
    if incoming.message is None:
        raise RuntimeError(f"no message to handle: {incoming.error}")
    return incoming.message


T = TypeVar("T")


def _present(value: T | None, missing: str) -> T:
    """`value`, which the shard's loop sets before any handler that reads it runs; RuntimeError(`missing`) if not."""
    if value is None:
        raise RuntimeError(missing)
    return value


class ShardServer:
    """One shard's conversation: registers with the scheduler, dispatches what arrives on its sockets in order,
    replies, and keeps the model's checkpoint and rollbacks in step with what the scheduler says.

    It owns the order of things, not the decisions: those are the ShardState's, the ServedJob's, the
    TrainingSetup's and each check's own module's (see the module's docstring).
    """

    def __init__(self, opts: PsOptions, metrics_host: str, metrics_port: int, curve: CurveKeys | None) -> None:
        self.opts = opts
        self.registry = CollectorRegistry()
        self.health = Health()
        self.metrics_server = MetricsServer(self.registry, self.health, metrics_host, metrics_port)
        self.ctx = open_context(curve)
        self.sock, self.endpoint = bind_router(self.ctx, opts.bind, connection_reports(self.registry, "ps"),
                                               SEND_QUEUE)
        self.advertise = opts.advertise or self.endpoint.replace("0.0.0.0", socket.gethostname())
        self.name = opts.name or f"ps-{socket.gethostname()}"
        self.stopping = False
        self.refusals = RateLimitedLog(log)
        self.job_over = False
        self.beat_due = False  # report now, not at the next heartbeat: the scheduler waits on it (push_bounds.py)
        self.parked: list[ParkedPull] = []
        self.senders = SenderBindings()  # which connection speaks for each live worker (senders.py)
        self.replays = ReplayGuard()  # the PUSH seqs already taken, per sender and connection (replay_guard.py)
        self.limits: WireLimits | None = None  # once the model is held: what a message may be (peer_limits.py)
        self.outbox = Outbox(self.sock, UNMODELLED_BACKLOG, self._reply_dropped)  # (ps/outbox.py)
        self.membership = 0  # the scheduler's number of the live worker set in self.state
        self.served: ServedJob | None = None  # the job, once the scheduler has welcomed this shard (served_job.py)
        self.state: ShardState | None = None  # set by the first worker's INIT, or from a checkpoint
        self.setup: TrainingSetup | None = None  # the model, optimizer and schedule the first INIT named
        self.buffers: SharedBuffers | None = None  # shard 0 of a model with travelling buffers (shared_buffers.py)
        self.reported_version = 0  # the model version last exported (dynabatch_ps_version)
        self.last_assignment: Assignment | None = None
        self.guard = ParamGuard()  # what is wrong with the model held, if anything (param_guard.py)
        self.healthy = True  # the guard's last verdict, as logged and exported
        self.good_version = -1  # the version of the last checkpoint written (only a healthy model is)
        self.rollbacks = 0  # the number of the last rollback applied (the scheduler's count)
        self.hold_checkpoints = False  # the scheduler sees workers' losses diverging: keep the last checkpoint
        self.link = SchedulerLink(self.ctx, opts.scheduler, opts.job, self.name, handshake_failures(self.registry))
        torch.set_num_threads(opts.threads)

    @property
    def served_job(self) -> ServedJob:
        """The job the scheduler welcomed this shard to; set before the loop starts."""
        return _present(self.served, "this shard has not been welcomed to a job yet")

    @property
    def model(self) -> ShardState:
        """This shard's part of the model; only once the first INIT (or a checkpoint) has set it."""
        return _present(self.state, "this shard holds no model yet (no INIT, no checkpoint)")

    @property
    def training(self) -> TrainingSetup:
        """The model, optimizer and schedule the first INIT named; set together with the model."""
        return _present(self.setup, "this shard holds no model yet (no INIT, no checkpoint)")

    @property
    def held_buffers(self) -> SharedBuffers:
        """The model's travelling buffers, on the shard that holds them (shard 0, once the model is here)."""
        return _present(self.buffers, "this shard holds no travelling buffers")

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ADDRESS_LOG.info("listening on %s (advertised to workers as %s), metrics on %s", self.endpoint, self.advertise,
                 self.metrics_server.url())
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
            self._checkpoint()
            self.link.bye()
            bounds = self.served_job.bounds
            log.info("the gradient bound (--gradient-bound %g) clipped %d pushes; %d workers quarantined; direction "
                     "scores: %s", bounds.factor, bounds.clipped, len(bounds.quarantined),
                     self.served_job.direction.summary())
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
        hello = Hello(role="ps", host=socket.gethostname(), metrics_url=self.metrics_server.url(),
                      endpoint=self.advertise, shard_index=shard_index, name=self.name)
        try:
            return self.link.register(hello, lambda: self.stopping, self.health.tick)
        except RemoteError as exc:
            log.error("scheduler refused this shard: %s", exc)
            return None

    def _setup(self, welcome: Welcome) -> None:
        """Take the job the scheduler welcomed this shard to, and resume its checkpoint if there is one."""
        served = self.served = ServedJob.welcomed(welcome, self.registry, self.opts.checkpoint_dir)
        self.link.conn.job = served.job.job
        self.link.watch_contact(self.health, served.job.liveness_timeout_s)
        saved = served.load_checkpoint()
        if saved is not None:
            self._create_state(TrainingSetup.from_checkpoint(saved), None)
            self.model.restore(saved)
            self._hold_buffers(self.training.signature, None)
            if self.buffers is not None:
                self.buffers.restore(saved.get("buffers", {}))
            self._bound_peers()
            self.reported_version = self.model.version
            self.replays.restore(saved.get("replay_marks", {}))
            self.rollbacks = int(saved.get("rollbacks", 0))
            self._judge_restored()
            log.info("resumed from %s at version %d (%d samples); updates after it are lost, and the scheduler "
                     "counts them back into the job", served.checkpoint_path, self.model.version,
                     self.model.samples_seen)
        else:
            log.info("shard %d of %d at %s: waiting for the first worker's model", served.index, served.job.shards,
                     self.advertise)
        served.metrics.version.set(self.reported_version)
        self.health.ready = True

    def _create_state(self, setup: TrainingSetup, flat: torch.Tensor | None) -> None:
        """This shard's part of the model `setup` describes, at `flat` (None: zeros, a checkpoint follows).

        `setup` is the first INIT's, already checked by `_on_init` (or written by this shard into its checkpoint).
        """
        served, sig = self.served_job, setup.signature
        self.state = served.new_state(sig, flat, setup.optimizer, setup.schedule)
        self.setup = setup
        self._watch(self.guard.reset(self.model.params))
        last = self.last_assignment
        if last is not None:  # what the scheduler said before the model was here
            self.model.follow_job(last.progress, last.lr_factor)
            self.model.set_membership(set(last.live_workers), last.allocated, set(last.idle_workers))
        log.info("shard %d of %d ready at %s: %d chunks of a %d-parameter model (%d here), protocol %s, %s",
                 served.index, served.job.shards, self.advertise, len(self.model.chunks), sig.total,
                 sum(c.length for c in self.model.chunks), served.job.protocol, self.model.optimizer)

    def _hold_buffers(self, sig: ModelSignature, flat: torch.Tensor | None) -> None:
        """Shard 0 holds all of the model's travelling buffers (they are small); the other shards none."""
        self.buffers = SharedBuffers.initial(sig.buffers, flat) if (
            self.served_job.index == 0 and sig.buffers) else None

    def _bound_peers(self) -> None:
        """Now that the model's size is known: refuse larger messages unparsed, queue fewer replies per peer."""
        sig = self.training.signature
        self.limits = wire_limits([c.length for c in self.model.chunks], self.buffers.total if self.buffers else 0,
                                  len(sig.params), len(sig.buffers))
        self.outbox.limit = backlog_limit(len(self.model.chunks))

    def _take_buffers(self, msg: Message, total: int) -> torch.Tensor | None:
        """Remove the travelling buffers' entry (always the last) from `msg` and return it, checked; None if absent.

        With `total` 0 (this shard holds no buffers) the entry is left in place,
        where check_chunks refuses it as a chunk not held here.
        """
        if not total or not msg.chunks or msg.chunks[-1].id != BUFFERS_ID:
            return None
        part = Message(msg.body, [msg.chunks.pop()], [msg.tensors.pop()], seq=msg.seq)
        check_chunks(part, {BUFFERS_ID: total})
        check_finite(part)
        return part.tensors[0]

    def _loop(self) -> None:
        job = self.served_job.job
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.conn.sock, zmq.POLLIN)
        self._beat()  # before serving anything: a resumed shard's first report is its checkpoint's version
        next_beat = time.monotonic() + job.heartbeat_s
        next_ckpt = time.monotonic() + self.opts.checkpoint_interval_s
        while not self.stopping and not self.job_over:
            self.outbox.flush()
            events = dict(poller.poll(timeout=self.outbox.poll_ms))
            if self.link.conn.sock in events:  # first: a worker told a new batch pushes it only after this shard was
                self._on_assignment(self.link.poll())
            if self.sock in events:
                pending = [recv_routed(self.sock, self.limits)]
                while len(pending) < MAX_BATCH_PER_POLL and self.sock.poll(0):
                    pending.append(recv_routed(self.sock, self.limits))
                for incoming in sorted(pending, key=priority):
                    self._handle(incoming)
            now = time.monotonic()
            if now >= next_beat or self.beat_due:
                self._beat()
                next_beat = now + job.heartbeat_s
            overdue = self.model.overdue(now, job.round_timeout_s) if self.state is not None else []
            if overdue:
                log.warning("%s rounds of %d chunks timed out; applying what arrived", job.protocol, len(overdue))
                self._after_update([cid for cid in overdue if self.model.close_round(cid)])
            self._expire_parked(now)
            if self.served_job.checkpoint_path is not None and now >= next_ckpt:
                self._checkpoint()
                next_ckpt = now + self.opts.checkpoint_interval_s
            self.health.tick()

    def _beat(self) -> None:
        """Report version and samples to the scheduler (a drop in them tells it this shard lost work).

        The answer to an earlier heartbeat may be taken here rather than by the loop's poll.
        """
        state = self.state
        version = state.version if state is not None else 0
        train_size = self.training.signature.train_size if self.setup is not None else 0
        discarded = state.discarded if state is not None else 0
        samples = state.samples_seen if state is not None else 0
        quarantined = sorted(self.served_job.bounds.quarantined & self.senders.live)  # the scheduler drops them
        self.beat_due = False
        self._on_assignment(self.link.heartbeat(Heartbeat(batches=self.served_job.assigned.told,
            version=version, updates=version, samples=samples, membership=self.membership,
            train_size=train_size, discarded=discarded, quarantined=quarantined,
            model_problem=self.guard.problem, good_version=self.good_version, rollbacks=self.rollbacks)))

    def _on_assignment(self, body: Assignment | None) -> None:
        if self.link.lost:
            log.warning("scheduler no longer knows this shard (restarted?); registering again")
            self._register(self.served_job.index)
            return
        if body is None:
            return
        self.last_assignment = body
        self.membership = body.membership
        self.hold_checkpoints = body.hold_checkpoints
        if self.state is None:
            self.rollbacks = max(self.rollbacks, body.rollbacks)  # no model yet: nothing to go back from
        elif body.rollbacks > self.rollbacks:
            self.model.follow_job(body.progress, body.lr_factor)  # the factor the restored model steps with
            self._roll_back(body.rollbacks)
            # Report the drop in version before serving another push, so that the scheduler counts the updates
            # thrown away back into the job; the heartbeat's answer (the newest assignment) is handled in full.
            self._beat()
            return
        served = self.served_job
        served.metrics.live.set(len(body.live_workers))
        self.senders.set_live(set(body.live_workers))
        if served.assigned.update(body.batches):
            self.beat_due = True  # a worker waits for this shard to report its larger bound before it gets it
        served.bounds.forget(set(body.live_workers))
        served.direction.forget(set(body.live_workers))
        if self.buffers is not None:
            self.buffers.forget(set(body.live_workers))
        if self.state is not None:
            self.model.follow_job(body.progress, body.lr_factor)
            self._after_update(self.model.set_membership(set(body.live_workers), body.allocated,
                                                         set(body.idle_workers)))
            self._serve_parked()
        if body.stop:
            log.info("job finished")
            self.job_over = True

    def _handle(self, incoming: Incoming) -> None:
        if incoming.error is not None:
            return self._reject(incoming, incoming.error)
        msg = message_of(incoming)
        start = time.perf_counter()
        try:
            if msg.job != self.served_job.job.job:
                raise ProtocolError(ErrorCode.WRONG_JOB,
                                    f"this shard serves job {self.served_job.job.job!r}, not {msg.job!r}",
                                    msg.seq)
            if isinstance(msg.body, Push):
                check_key_role(incoming.key_role, ("worker",), msg.type)
            elif isinstance(msg.body, (Init, Pull)):  # an evaluator checks its model (INIT) and reads it
                check_key_role(incoming.key_role, ("worker", "evaluator"), msg.type)
            if isinstance(msg.body, (Init, Pull, Push)):
                self.senders.check(msg.sender, incoming.identity)
            if isinstance(msg.body, Init):
                self._on_init(incoming)
            elif isinstance(msg.body, (Pull, Push)) and self.state is None:
                raise ProtocolError(ErrorCode.NOT_INITIALIZED,
                                    "no worker has sent this shard its model yet (INIT)", msg.seq)
            elif isinstance(msg.body, Pull):
                self._on_pull(incoming)
            elif isinstance(msg.body, Push):
                self._on_push(incoming)
            else:
                raise ProtocolError(ErrorCode.UNEXPECTED_TYPE, f"a shard does not take {msg.type}", msg.seq)
        except ProtocolError as exc:
            exc.ref = msg.seq
            self._reject(incoming, exc)
        except Exception as exc:  # a bug must cost one message, never the shard
            log.exception("internal error handling %s from %s", msg.type, msg.sender)
            self._reject(incoming, ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", msg.seq))
        self.served_job.metrics.handle.labels(self.served_job.label, msg.type).observe(time.perf_counter() - start)

    def _reject(self, incoming: Incoming, error: ProtocolError) -> None:
        self.served_job.metrics.bad.labels("ps", error.code).inc()
        self.refusals.refused(error.code, str(error))
        self._reply(incoming.identity, error.to_error(), error.ref)

    def _reply(self, identity: bytes, body: object, seq: int, metas: Sequence[ChunkMeta] = (),
               tensors: Sequence[torch.Tensor | memoryview] = ()) -> None:
        served = self.served_job
        self.outbox.send(identity, reply_frames(body, seq, served.job.job, f"ps{served.index}", metas, tensors))

    def _on_init(self, incoming: Incoming) -> None:
        """The first INIT sets the model; every later one must describe the same model."""
        msg = message_of(incoming)
        body: Init = msg.body
        try:
            setup = TrainingSetup.from_init(body)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"INIT: {exc}") from None
        optimizer_spec(self.served_job.job, body.optimizer)  # a malformed spec is refused before anything is built
        sig = setup.signature
        if self.state is not None:
            difference = self.training.difference(setup)
            if difference is not None:
                raise ProtocolError(ErrorCode.SIGNATURE, f"this model differs from the job's: {difference}")
            self._reply(incoming.identity, InitAck(self.model.version), msg.seq)
            return
        mine = {c.id: c for c in self.served_job.chunks(sig)}
        holds_buffers = sig.buffer_total if self.served_job.index == 0 else 0
        buffers = self._take_buffers(msg, holds_buffers)
        if holds_buffers and buffers is None:
            raise ProtocolError(ErrorCode.BAD_CHUNK,
                                f"INIT lacks the model's {len(sig.buffers)} buffers (chunk {BUFFERS_ID})")
        check_chunks(msg, {c.id: c.length for c in mine.values()})
        if len(msg.chunks) != len(mine):
            raise ProtocolError(ErrorCode.BAD_CHUNK,
                                f"INIT carries {len(msg.chunks)} of this shard's {len(mine)} chunks")
        check_finite(msg)
        flat = torch.zeros(sig.total)
        for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
            chunk = mine[meta.id]
            flat[chunk.start:chunk.stop] = tensor
        self._create_state(setup, flat)
        self._hold_buffers(sig, buffers)
        self._bound_peers()
        self._checkpoint()  # a shard killed before its first interval checkpoint resumes this model, not nothing
        log.info("initialised by %s: %d parameters", msg.sender, sig.total)
        self._reply(incoming.identity, InitAck(0, initialized=True), msg.seq)

    def _on_pull(self, incoming: Incoming) -> None:
        msg = message_of(incoming)
        body: Pull = msg.body
        if body.buffers and self.buffers is None:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                "PULL.buffers: this shard holds no buffers (shard 0 holds a model's "
                                "travelling buffers, if it has any)")
        self._serve_pull(incoming.identity, msg.seq, msg.sender, body.ids, body.min_version, body.buffers)

    def _check_room(self, identity: bytes, parks: bool) -> None:
        """Refuse a pull while this connection's earlier answers wait unread, or one that would park while it
        already has its fill of parked pulls (`parks`)."""
        if self.outbox.full(identity):
            raise ProtocolError(ErrorCode.BUSY,
                                f"{self.outbox.limit} answers to this connection wait unread; read them "
                                "before asking again")
        if parks and sum(p.identity == identity for p in self.parked) >= MAX_PARKED_PER_PEER:
            raise ProtocolError(ErrorCode.BUSY,
                                f"{MAX_PARKED_PER_PEER} pulls from this connection already wait; read their "
                                "answers before asking again")

    def _serve_pull(self, identity: bytes, seq: int, worker: str, ids: list[int], min_version: int,
                    buffers: bool) -> None:
        """Send the chunks (`ids`, or all) that are due now and park the rest (a PULL, or a PUSH's `then_pull`)."""
        items = self.model.pull(ids)
        due = [cid for cid, _, _ in items if self.model.due(cid, worker, min_version)]
        self._check_room(identity, len(due) < len(items) or self.model.pull_blocked(worker))
        ready = due if self.model.admit_pull(worker) else []
        waiting = [cid for cid, _, _ in items if cid not in ready]
        self.served_job.metrics.pulls.inc()
        self._send_chunks(identity, seq, ready, worker if buffers else None)
        if waiting:
            self.parked.append(ParkedPull(identity, seq, worker, waiting, min_version,
                                          time.monotonic() + self.served_job.job.round_timeout_s * 2,
                                          buffers and not ready))

    def _send_chunks(self, identity: bytes, seq: int, ids: list[int], buffers_to: str | None = None) -> None:
        """One PARAMS message per chunk, in priority order, each a zero-copy view of the chunk; the first
        also carries the travelling buffers if they are due to worker `buffers_to` (read as they leave)."""
        for cid, tensor, ver in self.model.pull(ids) if ids else []:
            metas = [ChunkMeta(cid, "float32", (tensor.numel(),), ver)]
            tensors: list[torch.Tensor | memoryview] = [self.model.lend(tensor)]  # a chunk lent zero-copy
            if buffers_to is not None:
                metas.append(ChunkMeta(BUFFERS_ID, "float32", (self.held_buffers.total,), self.model.version))
                tensors.append(self.held_buffers.sent_to(buffers_to))
                buffers_to = None
            self._reply(identity, Params(version=self.model.version), seq, metas, tensors)
            self.served_job.metrics.bytes_out.inc(sum(m.nbytes for m in metas))

    def _on_push(self, incoming: Incoming) -> None:
        msg = message_of(incoming)
        body: Push = msg.body
        buffers = self._take_buffers(msg, self.buffers.total if self.buffers is not None else 0)
        if not msg.chunks:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "PUSH carries no chunks")
        check_chunks(msg, self.model.sizes)
        check_finite(msg)
        if body.then_pull:  # refused now, not once the push is applied
            self._check_room(incoming.identity, True)
        tensors = {meta.id: t for meta, t in zip(msg.chunks, msg.tensors, strict=True)}
        base = {meta.id: meta.version for meta in msg.chunks}
        served = self.served_job
        m = served.metrics
        self.model.check_base(base)  # before the numbers: a base a rollback threw away is not a lie (bad_field)
        check_push_numbers(body.samples, base, self.model.chunk_versions, served.max_samples)
        if msg.sender in self.model.live:  # one that is not is refused `unknown_sender` (it may just be joining)
            check_push_samples(body.samples, msg.sender, served.assigned)
        self.replays.check(msg.sender, incoming.identity, msg.seq)
        streamed: set[int] = set()

        def send_back(cid: int) -> None:
            if self.model.due(cid, msg.sender, body.pull_min_version):
                self._send_chunks(incoming.identity, msg.seq, [cid])
                streamed.add(cid)

        found = served.bounds.assess(msg.sender, tensors, body.samples, self.model.params, self.model.live,
                                     self.model.share(body.samples))
        held = None if self.model.one_per_round else \
            served.direction.held(msg.sender, self.model.live - self.model.idle - served.bounds.quarantined)
        if held is not None:  # a start-up lead: only its direction counts
            self._count_bounds(found, taken=False)
            self._protocol_refusal(incoming, msg, ProtocolError(ErrorCode.HELD, held),
                                   m.held.labels(served.label, msg.sender))
            return
        streams = body.then_pull and self.buffers is None and self.model.streams
        try:
            outcome = self.model.push(msg.sender, found.tensors, base, body.samples, body.kind, time.monotonic(),
                                      send_back if streams else None)
        except StaleGradient as exc:
            self._protocol_refusal(incoming, msg, exc, m.discarded)
            return
        self.replays.take(msg.sender, incoming.identity, msg.seq, self.model.live)
        self._count_bounds(found)
        if buffers is not None:  # only once the push is taken: a refused one leaves no trace
            self.held_buffers.take(msg.sender, buffers, body.samples)
        m.staleness.observe(outcome.staleness)
        m.clock_spread.set(self.model.clock_spread)
        m.pushes.labels(served.label, msg.sender).inc()
        m.bytes_in.inc(sum(c.nbytes for c in msg.chunks) + (buffers.numel() * 4 if buffers is not None else 0))
        all_applied = len(outcome.applied) == len(tensors)
        self._reply(incoming.identity, PushAck(outcome.version, outcome.staleness, all_applied), msg.seq)
        self._after_update(outcome.applied)
        if body.then_pull:
            rest = [c.id for c in self.model.chunks if c.id not in streamed]
            if rest:
                self._serve_pull(incoming.identity, msg.seq, msg.sender, rest, body.pull_min_version,
                                 self.buffers is not None)
            else:
                m.pulls.inc()

    def _protocol_refusal(self, incoming: Incoming, msg: Message, refusal: ProtocolError, counter: Counter) -> None:
        """Refuse a push as the protocol at work (a gradient too stale, a start-up lead held), not as a bad message:
        its seq is taken (a replay of it is refused as one), it is counted in `counter` apart from bad messages,
        and not logged."""
        self.replays.take(msg.sender, incoming.identity, msg.seq, self.model.live)
        counter.inc()
        self._reply(incoming.identity, refusal.to_error(), msg.seq)

    def _count_bounds(self, found: Assessment, taken: bool = True) -> None:
        """Record a push's direction, and a taken one's norms; count a clipped one, and quarantine its worker if it
        keeps being clipped or keeps pointing against the other workers. A held push was not taken: only its
        direction counts."""
        served = self.served_job
        if taken and found.clipped:
            served.metrics.clipped.labels(served.label, found.worker).inc()
        if taken and served.bounds.record(found, self.model.live):
            self._quarantined(found.worker, "norm", f"{QUARANTINE_AFTER} pushes in a row exceeded the gradient bound "
                              f"(--gradient-bound {served.bounds.factor:g})")
        elif served.direction.record(found.worker, found.tensors, self.model.live, taken):
            served.bounds.quarantine(found.worker, "pointing against the other workers' gradients (--direction-check)")
            self._quarantined(found.worker, "direction", "its pushes point against most other workers' "
                              f"({served.direction.agreements(found.worker)}; --direction-check)")

    def _quarantined(self, worker: str, reason: str, why: str) -> None:
        served = self.served_job
        served.metrics.quarantined.labels(served.label, reason).inc()
        log.warning("%s quarantined: %s; its further pushes are refused and the scheduler is told", worker, why)
        self._beat()

    def _after_update(self, applied: list[int]) -> None:
        """Count applied chunk updates, move the travelling buffers, and stream the chunks to the pulls
        that were waiting for them."""
        if not applied:
            return
        for cid in applied:
            problem = self.guard.updated(cid, self.model.params)
        self._watch(problem)
        if self.buffers is not None:
            self.buffers.settle()  # once per update: the mean of the buffer changes pushed since the last
        before = self.reported_version
        self.reported_version = self.model.version
        self.served_job.metrics.updates.inc(self.reported_version - before)
        self.served_job.metrics.version.set(self.reported_version)
        self._serve_parked()

    def _serve_parked(self) -> None:
        """Send waiting pulls the chunks that are now due: at their version, and their worker let through."""
        for p in self.parked:
            if not self.model.admit_pull(p.worker):
                continue
            due = [cid for cid in p.remaining if self.model.due(cid, p.worker, p.min_version)]
            if due:
                self._send_chunks(p.identity, p.seq, due, p.worker if p.buffers else None)
                p.buffers = False
                p.remaining = [cid for cid in p.remaining if cid not in due]
        self.parked = [p for p in self.parked if p.remaining]

    def _expire_parked(self, now: float) -> None:
        """A parked pull past its deadline gets the current chunks rather than waiting forever."""
        expired = [p for p in self.parked if p.deadline <= now]
        if expired:
            self.parked = [p for p in self.parked if p.deadline > now]
            for p in expired:
                self._send_chunks(p.identity, p.seq, p.remaining, p.worker if p.buffers else None)

    def _watch(self, problem: str) -> None:
        """Export the guard's view; log when the model turns sick or healthy again."""
        norm, was_healthy, self.healthy = self.guard.norm, self.healthy, not problem
        self.served_job.metrics.param_norm.set(norm)
        self.served_job.metrics.model_healthy.set(1.0 if self.healthy else 0.0)
        if problem and was_healthy:
            log.error("model diverged at version %d: %s; no checkpoint is written until it is healthy again "
                      "(the last good one is version %d), and the scheduler is told", self.model.version, problem,
                      self.good_version)
        elif not problem and not was_healthy:
            log.info("model healthy again at version %d (parameter norm %.3g)", self.model.version, norm)

    def _judge_restored(self) -> None:
        """Judge a model just restored from its checkpoint, which becomes the last good one if it is healthy."""
        self._watch(self.guard.reset(self.model.params))
        if not self.guard.problem:
            self.good_version = self.model.version

    def _roll_back(self, number: int) -> None:
        """Restore the last good checkpoint (the scheduler's rollback `number`), once per number.

        The version drops: the scheduler counts the updates after the checkpoint
        back into the job, as for a restart, and workers whose pushes were computed
        on the diverged model are refused (their base version is ahead) and pull again.
        Pulls parked for versions the model no longer reaches get the restored chunks now.
        """
        served = self.served_job
        self.rollbacks = number
        served.metrics.rollbacks.inc()
        try:
            saved = served.load_checkpoint()
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("rollback %d ordered, but the checkpoint cannot be read: %s; the model stays as it is",
                      number, exc)
            return
        if saved is None:
            log.error("rollback %d ordered, but this shard has no checkpoint to go back to (--checkpoint-dir); "
                      "the model stays as it is", number)
            return
        before = self.model.version
        self.model.roll_back(saved)
        if self.buffers is not None:
            self.buffers.restore(saved.get("buffers", {}))
        self._judge_restored()
        self.reported_version = self.model.version
        served.metrics.version.set(self.reported_version)
        log.warning("rollback %d: restored version %d from %s (the model was at version %d); step size now x%g",
                    number, self.model.version, served.checkpoint_path, before, self.model.step_size.job_factor)
        self._expire_parked(math.inf)

    def _checkpoint(self) -> None:
        served = self.served_job
        if served.checkpoint_path is None or self.state is None:
            return
        if self.guard.problem or self.hold_checkpoints:
            served.metrics.checkpoints_refused.inc()
            log.warning("not checkpointing version %d: %s; the checkpoint at version %d stays", self.model.version,
                        self.guard.problem or "workers' losses are diverging", self.good_version)
            return
        buffers = self.buffers.named() if self.buffers is not None else {}  # {name: tensor}, as export reads them
        try:
            served.save_checkpoint({**self.model.snapshot(), **self.training.checkpoint_fields(), "buffers": buffers,
                                    "replay_marks": self.replays.saved(), "rollbacks": self.rollbacks})
        except OSError as exc:
            if not out_of_descriptors(exc):
                raise
            log.warning("checkpoint of version %d not written: %s; the one at version %d stays",
                        self.model.version, exc.strerror, self.good_version)
            return
        self.good_version = self.model.version
        served.metrics.checkpoints.inc()
        log.info("checkpoint at version %d written to %s", self.model.version, served.checkpoint_path)
