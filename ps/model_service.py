"""Workers' PULLs and PUSHes answered on the model a shard holds, in the order each takes.

A PULL gets the chunks due now, one PARAMS message each in priority order (a
zero-copy view of the chunk; the first also carries shard 0's travelling
buffers when they were asked for), and the rest are parked until they are due
(parked_pulls.py). A PUSH is admitted by the checks of push_admission.py, in the
order of its `STEPS`, taken by the model (ShardState: the protocol's own checks
and rounds), answered with its version and staleness, and, with `then_pull`,
followed by the pull it carries: chunks are sent back one by one as they are
taken where the protocol allows it (`streams`), the rest as a pull. Every update
is judged for the model's health (good_checkpoint.py), settles the travelling
buffers, is counted and exported, and lets the parked pulls have what is now due.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from dynabatch.common.config import check_flags_against_task
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.protocol_switch import SWITCHABLE, switch_to
from dynabatch.common.protocols import protocol_settings
from dynabatch.common.wire.chunking import BUFFERS_ID
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ChunkMeta, Message, ProtocolError
from dynabatch.common.wire.messages import Params, Pull, Push, PushAck, ShardAssignment
from dynabatch.optim import OptimizerSpec
from dynabatch.ps.good_checkpoint import GoodCheckpoint
from dynabatch.ps.held_model import HeldModel
from dynabatch.ps.outbox import Outbox
from dynabatch.ps.parked_pulls import ParkedPull, ParkedPulls
from dynabatch.ps.push_admission import PushAdmission, PushCase
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.serving_load import ServingLoad
from dynabatch.ps.shard_state import ProtocolRefusal

log = logging.getLogger("dynabatch.ps")
# Send a reply (body, chunk entries, tensor frames) to a connection, as the answer to its request `seq`.
Reply = Callable[[bytes, object, int, Sequence[ChunkMeta], Sequence[torch.Tensor | memoryview]], None]


class ModelService:
    """Pulls and pushes on `held`, for the job `served`; replies go through `reply`, whose queue per connection is
    `outbox`'s; a worker quarantined by a push is told to the scheduler through `tell_scheduler`; what moved, and
    who pushed, is counted in `load`."""

    def __init__(
        self,
        served: ServedJob,
        held: HeldModel,
        kept: GoodCheckpoint,
        replays: ReplayGuard,
        outbox: Outbox,
        reply: Reply,
        tell_scheduler: Callable[[], None],
        load: ServingLoad,
    ) -> None:
        self.served = served
        self.load = load
        self.held = held
        self.model = held.state
        self.elements = sum(c.length for c in held.state.chunks)  # of the model's parts this shard holds
        self.kept = kept
        self.outbox = outbox
        self.reply = reply
        self.parked = ParkedPulls()
        self.ranks: dict[str, int] = {}  # the scheduler's serving rank of each worker (ps/serve_order.py)
        self.admission = PushAdmission(replays, lambda identity: self.check_room(identity, True), tell_scheduler)
        self.reported_version = self.model.version  # the model version last exported (dynabatch_ps_version)

    @property
    def task_optimizer(self) -> OptimizerSpec | None:
        """The shards' optimizer where the model's task names one (None: the job's SGD from its flags)."""
        return self.model.optimizer if self.held.setup.optimizer else None

    def pull(self, msg: Message[Pull], identity: bytes) -> None:
        body = msg.body
        if body.buffers and self.held.buffers is None:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                "PULL.buffers: this shard holds no buffers (shard 0 holds a model's travelling buffers, if it has any)",
            )
        self._serve_pull(identity, msg.seq, msg.sender, body.ids, body.min_version, body.buffers)

    def push(self, msg: Message[Push], identity: bytes) -> None:
        held, model = self.held, self.model
        body = msg.body
        case = PushCase(msg, identity, self.served, model, held.buffer_total)
        streamed: set[int] = set()

        def send_back(cid: int) -> None:
            if model.due(cid, msg.sender, body.pull_min_version):
                self.send_chunks(identity, msg.seq, [cid])
                streamed.add(cid)

        streams = body.then_pull and held.buffers is None and model.streams
        try:
            self.admission.admit(case)
            outcome = model.push(
                msg.sender,
                case.assessed.tensors,
                case.base,
                body.samples,
                body.kind,
                time.monotonic(),
                send_back if streams else None,
            )
        except ProtocolRefusal as refusal:  # the protocol at work (held, too stale): counted apart from bad messages
            self.admission.refused(case, refusal)
            self.reply(identity, refusal.to_error(), msg.seq, (), ())
            return
        self.admission.taken(case)
        self.load.moved(sum(t.numel() for t in case.tensors.values()), self.elements)  # chunks checked as ours
        m = self.served.metrics
        buffer_bytes = 0
        if case.buffers is not None and held.buffers is not None:  # only once the push is taken
            held.buffers.take(msg.sender, case.buffers, body.samples)
            buffer_bytes = case.buffers.numel() * 4
        m.staleness.observe(outcome.staleness)
        m.clock_spread.set(model.clock_spread)
        m.pushes.labels(self.served.label, msg.sender).inc()
        m.bytes_in.inc(sum(c.nbytes for c in msg.chunks) + buffer_bytes)
        all_applied = len(outcome.applied) == len(case.tensors)
        self.reply(identity, PushAck(outcome.version, outcome.staleness, all_applied), msg.seq, (), ())
        self.after_update(outcome.applied)
        if body.then_pull:
            rest = [c.id for c in model.chunks if c.id not in streamed]
            if rest:
                self._serve_pull(identity, msg.seq, msg.sender, rest, body.pull_min_version, held.buffers is not None)
            else:
                m.pulls.inc()

    def after_update(self, applied: list[int]) -> None:
        """Judge the model's health, move the travelling buffers, count the updates, and stream the chunks to the
        pulls that were waiting for them."""
        if not applied:
            return
        self.kept.updated(applied, self.model)
        if self.held.buffers is not None:
            self.held.buffers.settle()  # once per update: the mean of the buffer changes pushed since the last
        self.served.metrics.updates.inc(self.model.version - self.reported_version)
        self.export_version()
        self.serve_parked()

    def follow(self, assignment: ShardAssignment) -> None:
        """The scheduler's word on the job: its progress and step-size factor, the live workers (rounds that waited
        only on workers that left close now), and the travelling buffers sent to workers still there."""
        live = set(assignment.live_workers)
        self._rank(dict(assignment.serve_ranks))
        if self.held.buffers is not None:
            self.held.buffers.forget(live)
        self.model.follow_job(assignment.progress, assignment.lr_factor)
        self.after_update(self.model.set_membership(live, assignment.allocated, set(assignment.idle_workers)))
        self.serve_parked()

    def switch(self) -> None:
        """The job's protocol changed (ServedJob.switch): the model takes its rule; the rounds it closes on the way
        are updates like any other, and the pulls parked for them are served."""
        job = self.served.job
        self.after_update(self.model.switch(job.protocol, protocol_settings(job)))
        self.serve_parked()

    def roll_back(self, assignment: ShardAssignment) -> None:
        """The scheduler's rollback `assignment.rollbacks`: the last good checkpoint restored (good_checkpoint.py)
        steps with the job's factor after it; pulls parked for the versions gone are answered with what is held."""
        self.model.follow_job(assignment.progress, assignment.lr_factor)
        if self.kept.roll_back(assignment.rollbacks, self.held):
            self.export_version()
            self.expire_parked(math.inf)

    def _rank(self, ranks: dict[str, int]) -> None:
        """Serve workers in the scheduler's order from now on, and export it (a worker no longer ranked goes)."""
        gauge, label = self.served.metrics.serve_rank, self.served.label
        for gone in self.ranks.keys() - ranks.keys():
            gauge.remove(label, gone)
        for worker, rank in ranks.items():
            gauge.labels(label, worker).set(rank)
        self.ranks = ranks

    def close_overdue(self, now: float) -> None:
        """Close the rounds that waited longer than --round-timeout-s with what arrived."""
        job = self.served.job
        overdue = self.model.overdue(now, job.round_timeout_s)
        if overdue:
            log.warning("%s rounds of %d chunks timed out; applying what arrived", job.protocol, len(overdue))
            self.after_update([cid for cid in overdue if self.model.close_round(cid)])

    def export_version(self) -> None:
        self.reported_version = self.model.version
        self.served.metrics.version.set(self.reported_version)

    def serve_parked(self) -> None:
        self.parked.serve(self.model, self.send_chunks, self.ranks)

    def expire_parked(self, now: float) -> None:
        self.parked.expire(now, self.send_chunks, self.ranks)

    def check_room(self, identity: bytes, parks: bool) -> None:
        """Refuse a pull while this connection's earlier answers wait unread, or one that would park while it
        already has its fill of parked pulls (`parks`)."""
        if self.outbox.full(identity):
            raise ProtocolError(
                ErrorCode.BUSY,
                f"{self.outbox.limit} answers to this connection wait unread; read them before asking again",
            )
        if parks:
            self.parked.check_room(identity)

    def _serve_pull(
        self, identity: bytes, seq: int, worker: str, ids: list[int], min_version: int, buffers: bool
    ) -> None:
        """Send the chunks (`ids`, or all) that are due now and park the rest (a PULL, or a PUSH's `then_pull`)."""
        model = self.model
        items = model.pull(ids)
        due = [cid for cid, _, _ in items if model.due(cid, worker, min_version)]
        self.check_room(identity, len(due) < len(items) or model.pull_blocked(worker))
        ready = due if model.admit_pull(worker) else []
        waiting = [cid for cid, _, _ in items if cid not in ready]
        self.served.metrics.pulls.inc()
        self.send_chunks(identity, seq, ready, worker if buffers else None)
        if waiting:
            self.parked.park(
                ParkedPull(
                    identity,
                    seq,
                    worker,
                    waiting,
                    min_version,
                    time.monotonic() + self.served.job.round_timeout_s * 2,
                    buffers and not ready,
                )
            )

    def send_chunks(self, identity: bytes, seq: int, ids: list[int], buffers_to: str | None = None) -> None:
        """One PARAMS message per chunk, in priority order, each a zero-copy view of the chunk; the first
        also carries the travelling buffers if they are due to worker `buffers_to` (read as they leave)."""
        model, buffers = self.model, self.held.buffers
        for cid, tensor, ver in model.pull(ids) if ids else []:
            metas = [ChunkMeta(cid, "float32", (tensor.numel(),), ver)]
            tensors: list[torch.Tensor | memoryview] = [model.lend(tensor)]  # a chunk lent zero-copy
            if buffers_to is not None and buffers is not None:
                metas.append(ChunkMeta(BUFFERS_ID, "float32", (buffers.total,), model.version))
                tensors.append(buffers.sent_to(buffers_to))
                buffers_to = None
            self.reply(identity, Params(version=model.version), seq, metas, tensors)
            self.served.metrics.bytes_out.inc(sum(m.nbytes for m in metas))
            self.load.moved(tensor.numel(), self.elements)


def unrunnable(served: ServedJob, task_optimizer: OptimizerSpec | None) -> bool:
    """Say, before `--protocol auto` chooses it, the first protocol auto may switch to (SWITCHABLE) that the held
    model's task keeps out (it names the shards' optimizer, `task_optimizer`, which a delta protocol's outer optimizer
    would replace): the heartbeat's
    `refused_protocol`, as after a refused switch, so that the scheduler leaves it out and no worker steps are spent
    on a switch the shard would refuse. True when there is one (a heartbeat is due)."""
    if served.refused_protocol:
        return False
    for candidate in SWITCHABLE:
        try:
            check_flags_against_task(replace(served.job, protocol=candidate), task_optimizer)
        except ConfigError as exc:
            log.info("protocol %s cannot run here, which --protocol auto is told: %s", candidate, exc)
            served.refused_protocol = candidate
            return True
    return False


def switch_protocol(served: ServedJob, serving: ModelService | None, protocol: str) -> bool:
    """The scheduler's order to apply `protocol` (`--protocol auto`): the served job, then the model it holds (if
    any) follow. Where the job cannot run it here (its flags, or a task that names the shards' optimizer under a
    delta protocol) the shard keeps its protocol and says so in its heartbeat (`refused_protocol`, logged once), and
    the scheduler chooses among the others. True: the next heartbeat is due at once."""
    previous = served.job.protocol
    try:
        served.switch(protocol, serving.task_optimizer if serving is not None else None)
    except ConfigError as exc:
        if switch_to(protocol, served.refused_protocol) is not None:  # logged once per protocol refused
            log.error(
                "the scheduler asked for protocol %s, which this shard cannot run: %s; keeping %s",
                protocol,
                exc,
                previous,
            )
        served.refused_protocol = protocol
        return True
    served.refused_protocol = ""
    if serving is not None:
        serving.switch()
    log.info("protocol %s from now on, was %s (the scheduler's --protocol auto)", protocol, previous)
    return True
