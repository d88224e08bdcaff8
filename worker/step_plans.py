"""Each protocol's worker step as a plan of actions, without sockets, tensors or clocks.

A planner decides what one step does and in which order: which model versions
its pull waits for, how many samples and local steps it computes, what it pushes,
and what the shards' answers mean for the next step. Two executors run the same
plans: the worker's socket loops (gradient_steps.py, local_steps.py) against
the shards, and the simulator (bench/simulate.py) in virtual time, so what is
simulated is what runs.

A planner's `step` is a generator: it yields actions, is sent each action's
outcome (a `Pulled` for a `Pull`, whether the computed step may be pushed for a
`Compute`, the acknowledgements for an awaited `Push`, whether the averaged model
came back for an `Advance`) and returns whether the step trained. What it reads
of its protocol comes from the protocol's spec (common/protocols.py), which the
shard's rule reads as well.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from dynabatch.common.protocols import DELTA, GRADIENT, ProtocolSpec
from dynabatch.common.wire.error_codes import ErrorCode


class Orders(Protocol):
    """What a step is told to do: the scheduler's assignment as the step reads it (a planner reads each field
    when it needs it, so an executor may hand it a view that changes while the step runs)."""

    @property
    def batch(self) -> int: ...

    @property
    def local_steps(self) -> int: ...


class Acknowledged(Protocol):
    """A shard's answer to a push: whether the push updated the model now, and the version after it."""

    @property
    def applied(self) -> bool: ...

    @property
    def version(self) -> int: ...


@dataclass(frozen=True)
class Ack:
    """An `Acknowledged` of the planner's own, for an executor whose shards answer with no message (the
    simulator's)."""

    applied: bool
    version: int


@dataclass(frozen=True)
class Pull:
    """Fetch the model; shard s answers once it holds version `min_versions[s]` (None: whatever it holds).
    `waits`: the time it takes is waiting for other workers (a round), not this worker's own pulling.
    `held`: answered by the model the worker holds (the one its last step computed on) with nothing sent; see
    `StepPlan.start_held`. Outcome: a `Pulled`."""

    min_versions: list[int] | None
    waits: bool
    held: bool = False


@dataclass(frozen=True)
class Pulled:
    """What a pull brought: each shard's version, and the model's (the least of them)."""

    shard_versions: list[int]
    version: int


@dataclass(frozen=True)
class Compute:
    """`steps` passes of `batch` samples on the model pulled last: one gradient, or as many local SGD steps.
    Outcome: whether the result may be pushed (a gradient whose loss is not finite may not)."""

    batch: int
    steps: int = 1


@dataclass(frozen=True)
class Push:
    """Send a gradient or a delta (`kind`) of `samples` samples. `then_pull`: what the next step's pull waits for,
    which an executor may ask for in the same round trip. `in_flight`: not awaited (msd); its averaged model
    comes back through `Advance`. Outcome: the shards' acknowledgements (None where not awaited)."""

    kind: str
    samples: int
    then_pull: list[int] | None = None
    in_flight: bool = False


@dataclass(frozen=True)
class Advance:
    """Look after the delta in flight without blocking; once its round's model is in, correct onto it.
    Outcome: whether it did (the delta is no longer in flight)."""


Action = Pull | Compute | Push | Advance
Step = Generator[Action, object, bool]


def send(step: Step, outcome: object) -> Action | None:
    """The step's next action once it is told `outcome` of the last one; None once the step is over."""
    try:
        return step.send(outcome)
    except StopIteration:
        return None


def finish(step: Step, outcome: object) -> None:
    """Tell the step the outcome of its last action; it must then be over."""
    if send(step, outcome) is not None:
        raise RuntimeError("the step planned more actions than its executor ran")


def round_after(acks: Iterable[Acknowledged]) -> list[int]:
    """Per shard, the version its model has once the round a push entered has closed: the version the push
    made, or the next one where the push waits in a round still open."""
    return [a.version if a.applied else a.version + 1 for a in acks]


def pulls_ahead(spec: ProtocolSpec) -> bool:
    """Whether a step's next pull can be sent ahead with its push (the scheduled wire): where the protocol takes one
    push per worker and round, so the versions that pull waits for are known when the push leaves."""
    return spec.one_push_per_round


def local_steps(orders: Orders) -> int:
    """H, the local steps per push: the assignment's, at least one."""
    return max(1, orders.local_steps)


class StepPlan:
    """One protocol's worker step; `NAME` is what a ProtocolSpec's `worker_loop` names. A worker's training ends
    when the scheduler says so (its allotment of the job's samples trained), never by the plan."""

    NAME: ClassVar[str]

    @classmethod
    def of(cls, spec: ProtocolSpec) -> StepPlan:
        """The planner for `spec` (most plans do not read it)."""
        return cls()

    def step(self, orders: Orders) -> Step:
        """The actions of one step under `orders`; returns whether it trained."""
        raise NotImplementedError

    def pull_waits(self) -> bool:
        """Whether a pull's time is waiting for other workers rather than this worker's own pulling."""
        raise NotImplementedError

    def after_failure(self, code: str) -> None:
        """A step failed with `code` (a shard's ERROR, `timeout`, or a rollback): get ready to try again."""
        raise NotImplementedError

    def start_held(self) -> bool:
        """The worker enters this plan on a protocol switch (`--protocol auto`) holding a model another protocol's
        step computed on: start from it where that is as good as a pull, and say whether it does. Not a gradient
        plan: a gradient on that model would be too stale for a round protocol's rule. A delta plan does: its
        delta is its progress from whatever model it starts on, which the outer rule never discards for its age,
        and on a shard-bound job every worker's pull after the switch would cost the shard a model's transfer
        (bench/RESULTS.md 64 and 65)."""
        return False


@dataclass
class GradientPlan(StepPlan):
    """Pull, one gradient, push: asgd, softsync, ssp, ringmaster, rennala, ssgd.

    Where the protocol takes one push per worker and round (ssgd), the next pull
    waits for the version the round this step pushed into produces.
    Where the shard holds a pull until the next round (rennala), that time is
    waiting. `min_versions` is what the next pull waits for (None: nothing).
    """

    NAME = "gradient"
    spec: ProtocolSpec
    min_versions: list[int] | None = None
    last_versions: list[int] | None = None

    @classmethod
    def of(cls, spec: ProtocolSpec) -> StepPlan:
        return cls(spec)

    def pull_waits(self) -> bool:
        return self.min_versions is not None or self.spec.held_pull_waits

    def pulled(self, shard_versions: list[int]) -> None:
        """The step computed on these shard versions and will push: set what the next pull waits for."""
        self.last_versions = shard_versions
        after = self.round_after(shard_versions)
        if after is not None:
            self.min_versions = after

    def round_after(self, shard_versions: list[int]) -> list[int] | None:
        """What the pull after a step computed on `shard_versions` waits for: the round that step pushes into, where
        the protocol takes one push per worker and round (None: nothing)."""
        return [v + 1 for v in shard_versions] if pulls_ahead(self.spec) else None

    def step(self, orders: Orders) -> Step:
        pulled = yield Pull(self.min_versions, self.pull_waits())
        assert isinstance(pulled, Pulled)
        self.last_versions = pulled.shard_versions
        batch = orders.batch
        if not (yield Compute(batch)):
            return False
        self.pulled(pulled.shard_versions)
        yield Push(GRADIENT, batch, then_pull=self.min_versions)
        return True

    def after_failure(self, code: str) -> None:
        """After "already pushed in this round" the next pull waits for that round; otherwise start over."""
        if self.spec.one_push_per_round and code == ErrorCode.BAD_STATE and self.last_versions is not None:
            self.min_versions = [v + 1 for v in self.last_versions]
        else:
            self.min_versions = None


@dataclass
class LocalPlan(StepPlan):
    """local: sync onto the global model (waiting for the round the last delta went into), H local steps,
    push the delta."""

    NAME = "local"
    min_versions: list[int] | None = None
    held: bool = False  # the next sync takes the model the worker holds (start_held)

    def pull_waits(self) -> bool:
        return True

    def start_held(self) -> bool:
        self.held = self.min_versions is None
        return self.held

    def step(self, orders: Orders) -> Step:
        held, self.held = self.held, False
        yield Pull(self.min_versions, waits=True, held=held)
        batch, steps = orders.batch, local_steps(orders)
        yield Compute(batch, steps)
        acks = yield Push(DELTA, batch * steps)
        assert isinstance(acks, list)
        self.min_versions = round_after(acks)
        return True

    def after_failure(self, code: str) -> None:
        """Start over from the current global model; a delta lost in flight is simply not counted."""
        self.min_versions, self.held = None, False


@dataclass
class MsdPlan(StepPlan):
    """msd: one local step at a time; once H have been taken since the last push and no delta is in flight, push
    the delta without waiting; its round's model comes back through `Advance`, while the worker steps on."""

    NAME = "msd"
    synced: bool = False
    in_flight: bool = False
    since_push: int = 0
    held: bool = False  # the sync takes the model the worker holds (start_held)

    def pull_waits(self) -> bool:
        return False

    def start_held(self) -> bool:
        self.held = not self.synced
        return self.held

    def step(self, orders: Orders) -> Step:
        if not self.synced:
            held, self.held = self.held, False
            yield Pull(None, waits=False, held=held)
            self.synced = True
        batch = orders.batch
        yield Compute(batch)
        self.since_push += 1
        if self.in_flight and (yield Advance()):
            self.in_flight = False
        if not self.in_flight and self.since_push >= local_steps(orders):
            yield Push(DELTA, batch * self.since_push, in_flight=True)
            self.in_flight, self.since_push = True, 0
        return True

    def after_failure(self, code: str) -> None:
        """Start over from the current global model, with no delta in flight."""
        self.synced = self.in_flight = self.held = False


def plan_for(spec: ProtocolSpec) -> StepPlan:
    """The planner of `spec`'s worker loop."""
    return PLANS[spec.worker_loop].of(spec)


PLANS: dict[str, type[StepPlan]] = {plan.NAME: plan for plan in (GradientPlan, LocalPlan, MsdPlan)}
"""The planners by the name a ProtocolSpec's `worker_loop` gives them (the worker's loop of the same name runs
each)."""
