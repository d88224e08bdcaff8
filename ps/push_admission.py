"""Whether a shard takes a PUSH: one declared pipeline of checks, run in the order of `STEPS`.

A push is checked before anything changes, the message before its claims and its
claims before its sender, each by the module that owns the rule: that it is a
well-formed push (chunks held here, of their sizes, finite; shard 0's travelling
buffers apart), that a push that is also a pull finds room for its answers
(peer_limits.py), that its base versions are not ones a rollback threw away (an
honest worker's step on the old model, refused `rolled_back`), that its numbers
can be true (push_bounds.py), that it was not taken before (replay_guard.py),
that its sender is not quarantined (gradient_bounds.py), is a live worker (one
that is joining is refused `unknown_sender` and sends again) and claims no more
samples than its batch (push_bounds.py); a push made under another protocol than
the shard's (`--protocol auto` switched it) is refused `switched` right after it is
found well formed, before anything counts against its worker. Only a push that passed all of these is
assessed: its norms bounded (gradient_bounds.py: a clipped chunk is a new tensor)
and its direction judged (gradient_direction.py: a start-up lead is `Held`).
What the protocol itself refuses (another kind, a second push in a round, a
gradient too stale) is the ShardState's, when it takes the push.

A push taken (`taken`) or refused by the protocol at work (`refused`) has its seq
kept, so that a replay of it is refused; a taken one's norms and direction are
recorded, and a worker that keeps being clipped or keeps opposing the others is
quarantined, which the scheduler is told at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import Message, ProtocolError, check_chunks, check_finite
from dynabatch.common.wire.messages import Push
from dynabatch.ps.gradient_bounds import QUARANTINE_AFTER, Assessment
from dynabatch.ps.push_bounds import check_push_numbers, check_push_samples
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ProtocolRefusal, ShardState
from dynabatch.ps.shared_buffers import take_buffers

log = logging.getLogger("dynabatch.ps")


class Held(ProtocolRefusal):
    """A push held by the direction check's start-up hold (gradient_direction.py): the protocol at work, not a
    bad message."""

    CODE = ErrorCode.HELD


@dataclass
class PushCase:
    """One PUSH on its way through the checks: the message, the connection it came on, the job and the model it
    would update, and what the checks found (its tensors by chunk id, their base versions, its travelling
    buffers, its bounded norms)."""

    msg: Message[Push]
    identity: bytes
    served: ServedJob
    model: ShardState
    buffer_total: int  # the travelling buffers' length on the shard that holds them, else 0
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    base: dict[int, int] = field(default_factory=dict)
    buffers: torch.Tensor | None = None
    found: Assessment | None = None

    @property
    def body(self) -> Push:
        return self.msg.body

    @property
    def sender(self) -> str:
        return self.msg.sender

    @property
    def assessed(self) -> Assessment:
        """The push's bounded tensors and norms; set by `norms_bounded`."""
        if self.found is None:
            raise RuntimeError("the push has not been assessed yet")
        return self.found


@dataclass
class PushAdmission:
    """The checks' shared parts: the replay guard, whether a connection has room for the answers of a pull
    (`room`, which raises `busy`), and whom to tell of a quarantine (`tell_scheduler`)."""

    replays: ReplayGuard
    room: Callable[[bytes], None]
    tell_scheduler: Callable[[], None]

    def admit(self, case: PushCase) -> None:
        """Run every step of `STEPS` on `case`, in order; the first that refuses raises (ProtocolError, `Held`)."""
        for step in STEPS:
            step(self, case)

    def taken(self, case: PushCase) -> None:
        """The model took the push: keep its seq, record its norms and direction."""
        self.replays.take(case.sender, case.identity, case.msg.seq, case.model.live)
        self.record(case, taken=True)

    def refused(self, case: PushCase, refusal: ProtocolRefusal) -> None:
        """The protocol refused the push at work (held, or too stale): its seq is kept (a replay of it is refused
        as one) and it is counted apart from bad messages."""
        self.replays.take(case.sender, case.identity, case.msg.seq, case.model.live)
        served = case.served
        if isinstance(refusal, Held):
            served.metrics.held.labels(served.label, case.sender).inc()
        else:
            served.metrics.discarded[refusal.CODE].inc()

    def record(self, case: PushCase, taken: bool) -> None:
        """Record a push's direction, and a taken one's norms; count a clipped one, and quarantine its worker if
        it keeps being clipped or keeps pointing against the other workers. A held push was not taken: only its
        direction counts."""
        served, found, live = case.served, case.assessed, case.model.live
        if taken and found.clipped:
            served.metrics.clipped.labels(served.label, found.worker).inc()
        if taken and served.bounds.record(found, live):
            self._quarantined(
                served,
                found.worker,
                "norm",
                f"{QUARANTINE_AFTER} pushes in a row exceeded the gradient "
                f"bound (--gradient-bound {served.bounds.factor:g})",
            )
        elif served.direction.record(found.worker, found.tensors, live, taken):
            served.bounds.quarantine(found.worker, "pointing against the other workers' gradients (--direction-check)")
            self._quarantined(
                served,
                found.worker,
                "direction",
                "its pushes point against most other workers' "
                f"({served.direction.agreements(found.worker)}; --direction-check)",
            )

    def _quarantined(self, served: ServedJob, worker: str, reason: str, why: str) -> None:
        served.metrics.quarantined.labels(served.label, reason).inc()
        log.warning("%s quarantined: %s; its further pushes are refused and the scheduler is told", worker, why)
        self.tell_scheduler()


def well_formed(admission: PushAdmission, case: PushCase) -> None:
    """Chunks held here, of their sizes and finite; shard 0's travelling buffers taken apart, checked alike."""
    msg = case.msg
    case.buffers = take_buffers(msg, case.buffer_total)
    if not msg.chunks:
        raise ProtocolError(ErrorCode.BAD_CHUNK, "PUSH carries no chunks")
    check_chunks(msg, case.model.sizes)
    check_finite(msg)
    case.tensors = {meta.id: t for meta, t in zip(msg.chunks, msg.tensors, strict=True)}
    case.base = {meta.id: meta.version for meta in msg.chunks}


def protocol_in_force(admission: PushAdmission, case: PushCase) -> None:
    """A push made under another protocol than the shard's is refused `switched` before anything is judged: the
    scheduler switched the protocol while it was on its way, which is no strike against its worker."""
    case.model.check_protocol(case.body.protocol)


def room_to_answer(admission: PushAdmission, case: PushCase) -> None:
    """A push that is also a pull is refused `busy` now, not once it is applied, if its answers would not fit."""
    if case.body.then_pull:
        admission.room(case.identity)


def base_not_rolled_back(admission: PushAdmission, case: PushCase) -> None:
    """Before the numbers: a base a rollback threw away is an honest worker's, not a lie (`bad_field`)."""
    case.model.check_base(case.base)


def numbers_possible(admission: PushAdmission, case: PushCase) -> None:
    check_push_numbers(case.body.samples, case.base, case.model.chunk_versions, case.served.max_samples)


def not_replayed(admission: PushAdmission, case: PushCase) -> None:
    admission.replays.check(case.sender, case.identity, case.msg.seq)


def sender_not_quarantined(admission: PushAdmission, case: PushCase) -> None:
    case.served.bounds.check_not_quarantined(case.sender)


def sender_live(admission: PushAdmission, case: PushCase) -> None:
    case.model.check_live(case.sender)


def samples_within_batch(admission: PushAdmission, case: PushCase) -> None:
    check_push_samples(case.body.samples, case.sender, case.served.assigned)


def norms_bounded(admission: PushAdmission, case: PushCase) -> None:
    """Clip the chunks whose norms exceed the bound (changes nothing yet: the push may still be refused)."""
    model = case.model
    case.found = case.served.bounds.assess(
        case.sender, case.tensors, case.body.samples, model.params, model.live, model.share(case.body.samples)
    )


def direction_not_held(admission: PushAdmission, case: PushCase) -> None:
    """A worker with a start-up lead is held: only its direction counts (protocols of one push per round keep
    every worker level by themselves)."""
    model, served = case.model, case.served
    if model.one_per_round:
        return
    held = served.direction.held(case.sender, model.live - model.idle - served.bounds.quarantined)
    if held is not None:
        admission.record(case, taken=False)
        raise Held(held)


Step = Callable[[PushAdmission, PushCase], None]
STEPS: tuple[Step, ...] = (
    well_formed,
    protocol_in_force,
    room_to_answer,
    base_not_rolled_back,
    numbers_possible,
    not_replayed,
    sender_not_quarantined,
    sender_live,
    samples_within_batch,
    norms_bounded,
    direction_not_held,
)
