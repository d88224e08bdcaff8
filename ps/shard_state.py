"""A shard's model state, without sockets.

State is kept per chunk: each chunk has its parameters, optimizer and
version, and the protocol's rule (protocol_rules.py) keeps each chunk's open
round. That is what lets a worker push a chunk's gradient the moment backward
has finished it, and lets a shard apply and serve chunks in priority order, one
at a time.

The server loop (server.py) decodes messages, the checks of push_admission.py
admit a push, and model_service.py (and held_model.py, good_checkpoint.py) call
`pull`, `push`, `set_membership`, `overdue`, `close_round` and `roll_back` here.
Everything that decides what the parameters become is in this file,
protocol_rules.py, update_rules.py and step_size.py (the learning-rate schedule
and the job's progress through it), and is tested directly against plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dynabatch.common.planning.protocol_switch import switch_to
from dynabatch.common.protocols import DELTA, OuterSettings, ProtocolSettings, ProtocolSpec, dbs_weight, protocol_spec
from dynabatch.common.wire.chunking import Chunk
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.optim import OptimizerSpec
from dynabatch.ps.param_buffers import ParamBuffers
from dynabatch.ps.protocol_rules import RULES, ShardRule
from dynabatch.ps.step_size import StepSize
from dynabatch.ps.update_rules import (
    ChunkOptimizer,
    OuterOptimizer,
    Segment,
    chunk_optimizer,
    chunk_segments,
    decay_runs,
)


class ProtocolRefusal(ProtocolError):
    """A push refused by the protocol at work, not as a bad message: its seq is kept and it is counted apart
    (push_admission.py). Each kind has its own `CODE`."""

    CODE: ClassVar[ErrorCode]

    def __init__(self, text: str) -> None:
        super().__init__(self.CODE, text)

    def __reduce__(self) -> tuple[type[ProtocolRefusal], tuple[str]]:  # type: ignore[override]
        return type(self), (self.text,)


class ProtocolSwitched(ProtocolRefusal):
    """A push computed under another protocol than the shard's (`--protocol auto` switched it while the step was on
    its way): nothing changed, no strike against its worker, which pulls and goes on under its next assignment's."""

    CODE = ErrorCode.SWITCHED


class StaleGradient(ProtocolRefusal):
    """A gradient computed on too old a model, discarded by the protocol (ssgd, msync, ringmaster, rennala): nothing
    changed, and the worker pulls the current model and computes again."""

    CODE = ErrorCode.TOO_STALE


@dataclass
class PushOutcome:
    """What a push did: `applied` lists the chunks it updated now (others wait in a round)."""

    applied: list[int]
    version: int
    staleness: int


@dataclass
class ShardState:
    """Parameter chunks, their optimizers, versions, the live workers, the protocol's rule and the step size.

    `allocated` is the number of workers the scheduler gave a batch (DBS-SGD's n);
    `live` can be larger while a worker joins. `optimizer` is the task's (or the
    job's SGD); under the delta protocols the chunks' optimizer is the outer one.
    `settings` are the protocol's own (common/protocols.py), of the class its spec
    names (None: that class's defaults); the rule reads them, nothing else does.
    `run_samples` is the samples of the whole job (training set x epochs; 0: the
    job counts no epochs), by which the samples pushed here move the schedule.
    """

    chunks: list[Chunk]
    optimizer: OptimizerSpec
    protocol: str
    global_batch: int
    settings: ProtocolSettings | None = None
    dbs_rule: str = "capped"  # how a gradient's samples weigh it (common/protocols.py, DBS_WEIGHTS)
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    optim: dict[int, ChunkOptimizer] = field(default_factory=dict)
    chunk_versions: dict[int, int] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    idle: set[str] = field(default_factory=set)  # live workers left out with batch 0: no round waits for them
    allocated: int = 0
    step_size: StepSize = field(default_factory=StepSize)  # the schedule at the job's progress (step_size.py)
    run_samples: float = 0.0
    samples_seen: int = 0  # samples pushed to this shard (each step counted once, on its first chunk)
    thrown_away: dict[int, int] = field(default_factory=dict)  # each chunk's highest version a rollback discarded
    discarded: int = 0  # pushes the protocol discarded as too stale (StaleGradient)
    discarded_samples: int = 0
    memory: ParamBuffers = field(default_factory=ParamBuffers)  # parameter tensors lent to replies, and spares
    decay: list[Segment] = field(default_factory=list)  # the runs of parameters sharing a weight decay (update_rules)
    spec: ProtocolSpec = field(init=False)
    rule: ShardRule = field(init=False)

    def __post_init__(self) -> None:
        self.spec = protocol_spec(self.protocol)
        if self.settings is None:
            self.settings = self.spec.settings()
        if type(self.settings) is not self.spec.settings:
            raise ValueError(
                f"protocol {self.protocol} takes {self.spec.settings.__name__}, not {type(self.settings).__name__}"
            )
        self.rule = self._fresh_rule()

    @classmethod
    def initial(
        cls,
        chunks: Sequence[Chunk],
        flat: torch.Tensor,
        optimizer: OptimizerSpec,
        protocol: str,
        global_batch: int,
        settings: ProtocolSettings | None = None,
        params: Sequence[tuple[str, int]] = (),
        dbs_rule: str = "capped",
        step_size: StepSize | None = None,
        run_samples: float = 0.0,
    ) -> ShardState:
        """State at version 0 from the model's initial flat parameters.

        `params` are the model's parameters (name, size) in flat order, for the
        optimizer's `no_decay`; without them every value takes its weight decay.
        """
        state = cls(
            sorted(chunks, key=lambda c: c.id),
            optimizer,
            protocol,
            global_batch,
            settings,
            dbs_rule=dbs_rule,
            step_size=step_size or StepSize(),
            run_samples=run_samples,
        )
        state.decay = decay_runs(params or [("", flat.numel())], optimizer)
        for c in state.chunks:
            state.params[c.id] = flat[c.start : c.stop].clone()
            state.optim[c.id] = state._fresh_optimizer(c)
            state.chunk_versions[c.id] = 0
        return state

    def _fresh_optimizer(self, c: Chunk) -> ChunkOptimizer:
        """Chunk `c`'s optimizer with no state: the outer one under a delta protocol, else the job's (or task's)."""
        if self.kind == DELTA:
            return OuterOptimizer(self.outer_settings, c.length)
        return chunk_optimizer(self.optimizer, self.params[c.id], chunk_segments(self.decay, c.start, c.stop))

    def switch(self, protocol: str, settings: ProtocolSettings) -> list[int]:
        """Apply `protocol` (with its `settings`) from now on, around the same parameters, versions, live workers
        and counts (`--protocol auto`: common/planning/protocol_switch.py). The open rounds close first with what
        arrived, so that no pull waits for a round that will not come; returns the chunks that updated. The chunk
        optimizers stay between protocols whose workers push the same kind, and start afresh where it changes
        (local SGD's outer optimizer from nothing, and the gradient optimizer's momentum after it)."""
        spec = protocol_spec(protocol)
        if type(settings) is not spec.settings:
            raise ValueError(f"protocol {protocol} takes {spec.settings.__name__}, not {type(settings).__name__}")
        closed = [cid for cid in sorted(self.params) if self.rule.close(cid)]
        kind = self.kind
        self.protocol, self.spec, self.settings = protocol, spec, settings
        if spec.push_kind != kind:
            self.optim = {c.id: self._fresh_optimizer(c) for c in self.chunks}
        self.rule = self._fresh_rule()
        self.rule.membership_changed()
        return closed

    def check_protocol(self, protocol: str) -> None:
        """Refuse (`switched`) a push that names another protocol than this shard's ("": not named)."""
        if switch_to(protocol, self.protocol) is not None:
            raise ProtocolSwitched(
                f"this shard applies {self.protocol} now, not {protocol} (the scheduler switched the protocol); "
                "pull the current model and step under your next assignment's protocol"
            )

    @property
    def outer_settings(self) -> OuterSettings:
        """The outer optimizer's settings, which a delta protocol's settings are."""
        assert isinstance(self.settings, OuterSettings), f"{self.protocol} has no outer optimizer"
        return self.settings

    @property
    def version(self) -> int:
        """The shard's model version: the number of updates every one of its chunks has had."""
        return min(self.chunk_versions.values())

    @property
    def sizes(self) -> dict[int, int]:
        return {c.id: c.length for c in self.chunks}

    @property
    def kind(self) -> str:
        """What workers push: gradients, or parameter deltas."""
        return self.spec.push_kind

    def pull(self, ids: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(id, tensor, version) for the asked chunks (all when `ids` is empty), in priority order."""
        wanted = sorted(set(ids)) if ids else [c.id for c in self.chunks]
        unknown = [i for i in wanted if i not in self.params]
        if unknown:
            raise ProtocolError(ErrorCode.UNKNOWN_CHUNK, f"chunks {unknown[:5]} are not held here")
        return [(i, self.params[i], self.chunk_versions[i]) for i in wanted]

    @property
    def lr_factor(self) -> float:
        """What every update's learning rate is multiplied by now (step_size.py)."""
        return self.step_size.factor

    @property
    def clock_spread(self) -> int:
        """Bounded-staleness protocols (ssp): the most clocks between live workers seen so far; else 0."""
        return self.rule.widest_spread

    @property
    def streams(self) -> bool:
        """Whether a push that is also a pull may have its chunks sent back one by one as they are taken."""
        return self.rule.STREAMS

    def pull_blocked(self, worker: str) -> bool:
        """Whether the protocol holds back `worker`'s pull for now (ssp: too far ahead of the slowest; rennala:
        the round has its samples on their way)."""
        return self.rule.pull_blocked(worker)

    def due(self, cid: int, worker: str, min_version: int) -> bool:
        """Whether chunk `cid` is due to `worker`'s pull that waits for `min_version`: it has reached that
        version, and (a pull that waits at all) the protocol lets it go (ssgd: not while the chunk's open
        round holds the worker's own push)."""
        return self.chunk_versions[cid] >= min_version and (min_version == 0 or self.rule.chunk_due(cid, worker))

    @property
    def one_per_round(self) -> bool:
        """Whether the protocol takes one push per worker and round, so that no worker can run ahead."""
        return self.rule.ONE_PER_ROUND

    def admit_pull(self, worker: str) -> bool:
        """Whether `worker`'s pull is answered now (not `pull_blocked`); call it only when the answer is sent,
        as the protocol may count the worker as computing on the model it gets (rennala)."""
        return self.rule.admit_pull(worker)

    def push(
        self,
        worker: str,
        tensors: dict[int, torch.Tensor],
        base_versions: dict[int, int],
        samples: int,
        kind: str,
        now: float,
        on_taken: Callable[[int], None] | None = None,
    ) -> PushOutcome:
        """Take one live worker's gradient or delta chunks of a positive number of samples; the caller has
        admitted the push (push_admission.py: ids, shapes, finiteness, numbers, sender).

        The protocol's own checks come before anything changes, so a refused push leaves no trace; one the
        protocol discards as too stale (StaleGradient) leaves only its count in `discarded`.
        `on_taken(cid)` runs after each chunk is taken, in priority order, so that the
        server can send chunk k back while chunk k+1 is being updated (`streams`).
        """
        if kind != self.kind:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"protocol {self.protocol} takes PUSH.kind {self.kind!r}, not {kind!r}"
            )
        self.rule.check(worker, list(tensors))
        staleness = {cid: max(0, self.chunk_versions[cid] - base_versions[cid]) for cid in tensors}
        limit = self.rule.max_delay()
        late = limit is not None and max(staleness.values(), default=0) >= limit
        if late or self.rule.round_full(worker, base_versions):
            self.rule.pushed(worker, samples)
            self.discarded += 1
            self.discarded_samples += samples
            why = (
                f"{max(staleness.values())} versions stale (the limit is {limit})"
                if late
                else "whose round already has the gradients it takes"
            )
            raise StaleGradient(f"{self.protocol} discards a gradient {why}; pull the current model")
        applied = []
        for cid in sorted(tensors):
            if self.rule.take(cid, worker, tensors[cid], samples, staleness[cid], now):
                applied.append(cid)
            if on_taken is not None:
                on_taken(cid)
        self.rule.pushed(worker, samples)
        if self.chunks[0].id in tensors:  # count each step once, on the shard's first chunk
            self.samples_seen += samples
            if self.run_samples:
                self.step_size.advance(self.samples_seen / self.run_samples)
        return PushOutcome(applied, self.version, max(staleness.values(), default=0))

    def check_live(self, worker: str) -> None:
        """Refuse (`unknown_sender`) a push from a worker the scheduler has not told this shard is live: one that
        is joining sends it again once the shard knows it (worker/ps_client.py)."""
        if worker not in self.live:
            raise ProtocolError(ErrorCode.UNKNOWN_SENDER, f"{worker!r} is not a live worker of this job")

    def follow_job(self, progress: float, job_factor: float) -> None:
        """The scheduler's word on the job: its progress (epoch / epochs; the schedule never moves back) and its
        step-size factor after rollbacks."""
        self.step_size.job_factor = job_factor
        self.step_size.advance(progress)

    def check_base(self, base_versions: dict[int, int]) -> None:
        """Refuse (`rolled_back`) a push computed on a version that a rollback threw away: an honest worker's
        step on the model before the rollback, not a lie about versions, and it should pull again."""
        stale = [
            cid for cid, v in base_versions.items() if self.chunk_versions[cid] < v <= self.thrown_away.get(cid, -1)
        ]
        if stale:
            raise ProtocolError(
                ErrorCode.ROLLED_BACK,
                f"PUSH of chunk {stale[0]} was computed on version "
                f"{base_versions[stale[0]]}, which the job rolled back; pull the model again",
            )

    def set_membership(self, workers: set[str], allocated: int, idle: AbstractSet[str] = frozenset()) -> list[int]:
        """New membership from the scheduler: the live workers, how many hold a batch, and those left out
        with batch 0 (`idle`).

        Rounds that waited only on workers that left (or were left out) close now; returns their chunks.
        """
        self.live = set(workers)
        self.idle = set(idle) & self.live
        self.allocated = allocated
        return self.rule.membership_changed()

    def overdue(self, now: float, timeout_s: float) -> list[int]:
        """Chunks whose open round is to close without the workers still missing: every open one, once one has waited
        longer than `timeout_s` (protocol_rules.py: a step's chunks form one round)."""
        return self.rule.overdue(now, timeout_s)

    def close_round(self, cid: int) -> bool:
        """Close chunk `cid`'s open round with whoever pushed (a worker we cannot reach is not waited on);
        True if the chunk was updated."""
        return self.rule.close(cid)

    def lend(self, tensor: torch.Tensor) -> memoryview:
        """A chunk's parameters (from `pull`) as bytes for a zero-copy reply: no later step writes them
        while the reply may still be read (param_buffers.py)."""
        return self.memory.lend(tensor)

    def share(self, samples: int) -> float:
        """A gradient of `samples` samples as a fraction of the even batch B/n, at most 1 (the capped DBS weight)."""
        return dbs_weight(samples, self.global_batch, self.allocated, "capped")

    def apply_step(self, cid: int, tensor: torch.Tensor) -> None:
        """One step of chunk `cid`'s optimizer now: a synchronous round's mean gradient, or mean delta."""
        self._publish(cid, self.optim[cid].step(self._step_input(cid), tensor, self.lr_factor))

    def apply_gradient(self, cid: int, grad: torch.Tensor, samples: int, weight: float) -> bool:
        """An asynchronous gradient of `samples` samples; True if chunk `cid` was updated now.

        SGD steps on it weighted by `weight` (DBS-SGD's weight, which scales what the
        gradient adds to the momentum buffer); an adaptive optimizer steps once B
        samples' gradients are in (update_rules.py).
        """
        given = self._step_input(cid)
        new = self.optim[cid].offer(given, grad, samples, self.global_batch, self.lr_factor, weight)
        if new is None:
            if given is not self.params[cid]:
                self.memory.retire(given)
            return False
        self._publish(cid, new)
        return True

    def _step_input(self, cid: int) -> torch.Tensor:
        """What chunk `cid`'s optimizer steps from: the parameters themselves, unless the optimizer steps in
        place while a reply still holds them; then a copy, in memory no reply holds."""
        current = self.params[cid]
        if not self.optim[cid].in_place or not self.memory.lent(current):
            return current
        return self.memory.spare(current).copy_(current)

    def _publish(self, cid: int, new: torch.Tensor) -> None:
        """Replace chunk `cid`'s parameters (the old tensor may still be in a pull's reply) and count the update."""
        if new is not self.params[cid]:
            self.memory.retire(self.params[cid])
        self.params[cid] = new
        self.chunk_versions[cid] += 1

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds, by reference: the caller saves the snapshot before the next update
        can touch the parameters or an optimizer's state."""
        return {
            "params": dict(self.params),
            "optimizer_state": {cid: opt.state_dict() for cid, opt in self.optim.items()},
            "chunk_versions": dict(self.chunk_versions),
            "samples_seen": self.samples_seen,
            "kind": self.kind,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """Load a checkpoint taken from a shard with the same chunks: at start-up, or to roll back a diverged
        model. Open rounds are dropped with the model they were computed on (a fresh rule)."""
        if set(saved["params"]) != set(self.params) or any(
            saved["params"][c.id].numel() != c.length for c in self.chunks
        ):
            raise ValueError("checkpoint holds different chunks than this shard's layout")
        self.params = dict(saved["params"])
        if saved.get("kind", self.kind) == self.kind:
            for cid, opt in self.optim.items():
                opt.load_state_dict(saved["optimizer_state"][cid])
        else:  # saved under a protocol of the other kind (before a switch): its optimizer's state is not this one's
            self.optim = {c.id: self._fresh_optimizer(c) for c in self.chunks}
        self.chunk_versions = dict(saved["chunk_versions"])
        self.samples_seen = int(saved.get("samples_seen", 0))
        self.rule = self._fresh_rule()
        self.rule.membership_changed()  # the live workers are the same: a rule that tracks them (ssp) learns them

    def roll_back(self, saved: dict[str, Any]) -> None:
        """Go back to the checkpoint `saved` (the last good one), remembering the versions thrown away so that
        pushes computed on them are refused `rolled_back` (`check_base`) rather than taken as lies. The step
        size's progress stays: the job's progress is the scheduler's, and it moves on."""
        self.thrown_away = {cid: max(v, self.thrown_away.get(cid, -1)) for cid, v in self.chunk_versions.items()}
        self.restore(saved)

    def _fresh_rule(self) -> ShardRule:
        """The protocol's rule with no round open."""
        if self.settings is None:  # __post_init__ sets the protocol's defaults first
            raise RuntimeError(f"{self.protocol}: no protocol settings")
        return RULES[self.spec.shard_rule](self, self.settings)
