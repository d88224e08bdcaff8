"""One class per update protocol on the shard: its round state and its arithmetic together.

`ShardState` (shard_state.py) owns the parameters, versions and live workers and
asks its rule, named by the protocol's spec (common/protocols.py), what a pushed
chunk does: apply now, wait in a round, or close one. The optimizers themselves
(the task's, the outer one) are in update_rules.py; a rule decides when to offer
them what: a step now (a synchronous round) or a gradient of b_i samples, which
an adaptive optimizer adds up to a batch of B before it steps.

A rule is told about every push only after `check` has passed for all of the
push's chunks, so a refused push leaves no trace in any round.

A rule that closes rounds hands the closed round's contributions, one per worker,
to the aggregation the protocol's settings name (aggregation.py, `--aggregation`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

from dynabatch.common.protocols import (
    SPECS,
    AsyncSettings,
    MsyncSettings,
    ProtocolSettings,
    RingmasterSettings,
    RoundSettings,
    SoftsyncSettings,
    SspSettings,
    dbs_weight,
)
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.aggregation import Contribution, aggregate
from dynabatch.ps.step_size import async_weight

if TYPE_CHECKING:
    from dynabatch.ps.shard_state import ShardState

log = logging.getLogger("dynabatch.ps")


def one_per_round(rule: str) -> bool:
    """Whether the protocols whose shard rule is `rule` take one push per worker and round: their specs'
    `one_push_per_round` (common/protocols.py), which must agree, as one rule serves them all."""
    flags = {spec.one_push_per_round for spec in SPECS.values() if spec.shard_rule == rule}
    if len(flags) > 1:
        raise ValueError(f"the protocols of shard rule {rule!r} disagree on one_push_per_round")
    return flags == {True}


class ShardRule:
    """What a protocol does with pushed chunks; the default rule keeps no rounds.

    `settings` are the protocol's own (common/protocols.py, the class its spec names).
    """

    NAME: ClassVar[str]
    # Whether a pushed chunk may be sent back (a push that is also a pull) as soon as it is taken: false where
    # whether the worker may pull at all is known only once its whole push is in (ssp's clocks).
    STREAMS: ClassVar[bool] = True
    # Whether a worker's push enters a round that takes one from each worker: it cannot run ahead of the others, so
    # the direction check's start-up hold (gradient_direction.py `held`) has nothing to bound. Derived from the
    # specs that name the rule (`one_per_round`), whose flag the worker's step planner reads as well.
    ONE_PER_ROUND: ClassVar[bool] = False
    widest_spread: int = 0  # bounded-staleness rules: the most clocks between live workers seen so far

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if "NAME" in cls.__dict__:
            cls.ONE_PER_ROUND = one_per_round(cls.NAME)

    def __init__(self, shard: ShardState, settings: ProtocolSettings) -> None:
        self.shard = shard
        self.settings = settings

    def check(self, worker: str, chunk_ids: list[int]) -> None:
        """Raise ProtocolError if `worker` may not push these chunks now (before anything changes)."""

    def max_delay(self) -> int | None:
        """A gradient this many or more versions stale (on any of its chunks) is discarded; None: never."""
        return None

    def take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        """Apply or hold one pushed chunk; True if the chunk was updated now."""
        raise NotImplementedError

    def membership_changed(self) -> list[int]:
        """The live workers changed (shard.live); returns the chunks updated because of it."""
        return []

    def overdue(self, now: float, timeout_s: float) -> list[int]:
        """Chunks whose open round is to close now, for having waited longer than `timeout_s`."""
        return []

    def close(self, cid: int) -> bool:
        """Apply chunk `cid`'s open round with whoever contributed; True if the chunk was updated
        (False: no round was open, or an adaptive optimizer waits for more samples)."""
        return False

    def pull_blocked(self, worker: str) -> bool:
        """Whether `worker`'s pull must wait (a bounded-staleness protocol holds back a worker too far ahead)."""
        return False

    def chunk_due(self, cid: int, worker: str) -> bool:
        """Whether chunk `cid` may be sent to `worker`'s pull that waits for a version (beyond reaching it)."""
        return True

    def admit_pull(self, worker: str) -> bool:
        """Whether `worker`'s pull is answered now; a rule may count an answered pull as a gradient on its way."""
        return not self.pull_blocked(worker)

    def pushed(self, worker: str, samples: int) -> None:
        """`worker` pushed a gradient of `samples` samples (taken or discarded)."""

    def round_full(self, worker: str, base_versions: dict[int, int]) -> bool:
        """Whether a gradient no older than `max_delay` allows is discarded all the same, its round having taken
        all the workers it takes (msync); asked once the push passed every other check, so it may count it in."""
        return False


class AsyncRule(ShardRule):
    """asgd (Downpour; DBS-SGD with dynamic batches): every gradient applied on arrival, weighted by its samples
    (`--dbs-weight`: min(1, b_i/(B/n)) or the paper's b_i/(B/n)) and by its staleness (`--staleness-step`)."""

    NAME = "async"
    settings: AsyncSettings

    def take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        shard = self.shard
        settings = self.settings
        weight = dbs_weight(samples, shard.global_batch, shard.allocated, shard.dbs_rule)
        weight = async_weight(settings.staleness_step, weight, staleness, samples, settings.delay_step_samples)
        return shard.apply_gradient(cid, tensor, samples, weight)


class StaleSynchronousRule(AsyncRule):
    """Stale-synchronous parallel (Ho et al. 2013): asynchronous updates, bounded clock spread.

    A worker's clock on this shard is the number of pushes of every chunk the
    shard holds that it has made (the least over the chunks, so a pipelined push
    of some chunks does not count as a step). A worker more than `staleness`
    clocks ahead of the slowest live worker holding a batch has its pulls held until the slowest
    catches up, so no worker ever computes on a model missing more than
    `staleness` of another's steps. s = 0 is lock-step (ssgd's versions per step),
    a large s is asgd. A worker that joins starts at the slowest live clock, so it
    holds nobody back.
    """

    NAME = "ssp"
    STREAMS = False
    settings: SspSettings

    def __init__(self, shard: ShardState, settings: ProtocolSettings) -> None:
        super().__init__(shard, settings)
        self.clocks: dict[str, dict[int, int]] = {}

    def take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        applied = super().take(cid, worker, tensor, samples, staleness, now)
        self.clocks[worker][cid] += 1
        self.widest_spread = max(self.widest_spread, self.spread())
        return applied

    def clock(self, worker: str) -> int:
        return min(self.clocks[worker].values(), default=0)

    def slowest(self) -> int:
        return min((self.clock(w) for w in self._stepping()), default=0)

    def spread(self) -> int:
        """Clocks between the fastest and the slowest live worker holding a batch."""
        clocks = [self.clock(w) for w in self._stepping()]
        return max(clocks) - min(clocks) if clocks else 0

    def _stepping(self) -> set[str]:
        """The live workers holding a batch: one left out with batch 0, or whose allotment of the job's samples is
        trained, takes no step, and nobody waits for its clock."""
        return (self.shard.live - self.shard.idle) & self.clocks.keys()

    def membership_changed(self) -> list[int]:
        live = self.shard.live
        start = min((self.clock(w) for w in live if w in self.clocks), default=0)
        for gone in set(self.clocks) - live:
            del self.clocks[gone]
        for new in live - set(self.clocks):
            self.clocks[new] = {c.id: start for c in self.shard.chunks}
        return []

    def pull_blocked(self, worker: str) -> bool:
        return worker in self.clocks and self.clock(worker) - self.slowest() > self.settings.staleness_bound


class RingmasterRule(ShardRule):
    """Ringmaster ASGD (Maranjyan, Tyurin, Richtarik, ICML 2025): asynchronous SGD that discards a gradient whose
    delay reaches R (`max_delay`; ShardState.push refuses it with TOO_STALE before anything changes, and its
    worker restarts from the current model), so no update is older than R - 1 versions.

    An accepted gradient of delay tau takes a step of lr * min(1, tau_C / tau) (the delay-adaptive step of
    Koloskova, Stich, Jaggi, NeurIPS 2022, and Mishchenko et al., NeurIPS 2022), tau_C = R / 2, the delay of
    a worker of the cluster's average speed being about R - 1 = n - 1 under the default R = n; and its samples
    weigh as in DBS-SGD but never above 1 (b_i / (B/n), capped), so a large batch is not amplified while stale.
    The delay-adaptive step rather than Ringmaster's own constant one (R alone): the two trained alike on the
    simulator (bench/RESULTS.md 16), and this one shrinks the step where a larger R or rate would otherwise let
    stale gradients in at full size.
    """

    NAME = "ringmaster"
    settings: RingmasterSettings

    def max_delay(self) -> int:
        return self.settings.threshold(len(self.shard.live))

    def weight(self, samples: int, staleness: int) -> float:
        """Its share of the batch times min(1, tau_C / tau), tau_C = R / 2; under `--staleness-step delay` asgd's
        step (`async_weight`) instead."""
        settings, share = self.settings, self.shard.share(samples)
        if settings.staleness_step != "constant":
            return async_weight(settings.staleness_step, share, staleness, samples, settings.delay_step_samples)
        return share * min(1.0, self.max_delay() / 2 / max(1, staleness))

    def take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        return self.shard.apply_gradient(cid, tensor, samples, self.weight(samples, staleness))


@dataclass
class SyncRound:
    """One chunk's bulk-synchronous round: every live worker's contribution, one each.

    Contributions are kept per worker and handed over in worker-id order when the
    round closes, so the result does not depend on arrival order: the same job
    gives the same parameters bit for bit, with one shard or several.
    """

    parts: dict[str, Contribution] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, worker: str, tensor: torch.Tensor, samples: int) -> None:
        if worker in self.parts:
            raise ValueError(f"{worker} already pushed in this round")
        self.parts[worker] = (tensor, samples)

    def complete(self, live: set[str]) -> bool:
        """Every live worker has pushed (workers that left are not waited for)."""
        return bool(self.parts) and live <= self.parts.keys()

    def contributions(self) -> list[Contribution]:
        """Each worker's tensor as received and its samples, in worker-id order."""
        return [self.parts[worker] for worker in sorted(self.parts)]


@dataclass
class PooledRound:
    """A round open to pushes from anyone, a fast worker's several times (softsync, rennala).

    Each worker's pushes are pooled into its own sample-weighted sum, each scaled
    as its rule says (softsync: by its staleness), so that the round hands over one
    contribution per worker: a robust aggregation (aggregation.py) counts a worker,
    not a push, and a fast liar cannot outvote the others by pushing more often.
    The sample-weighted mean of the pooled contributions is the mean of the pushes.
    """

    sums: dict[str, Contribution] = field(default_factory=dict)  # worker -> (sum of b_j x_j, sum of b_j)
    pushes: int = 0
    samples: int = 0

    def __bool__(self) -> bool:
        return self.pushes > 0

    def add(self, worker: str, tensor: torch.Tensor, samples: int, scale: float = 1.0) -> None:
        """Add scale * b * tensor to `worker`'s sum; never writes into a received tensor."""
        if worker in self.sums:
            total, pooled = self.sums[worker]
            self.sums[worker] = (total.add_(tensor, alpha=samples * scale), pooled + samples)
        else:
            self.sums[worker] = (tensor.mul(samples * scale), samples)
        self.pushes += 1
        self.samples += samples

    def contributions(self) -> list[Contribution]:
        """Each worker's per-sample mean (its sum over its samples) and its samples, in worker-id order."""
        return [(total.div(pooled), pooled) for total, pooled in (self.sums[w] for w in sorted(self.sums))]


def softsync_needed(live_workers: int, n: int) -> int:
    """c = floor(workers / n), at least 1: how many gradients an n-softsync update waits for."""
    return max(1, live_workers // max(1, n))


RoundT = TypeVar("RoundT", bound="SyncRound | PooledRound")


class _RoundRule(ShardRule, Generic[RoundT]):
    """Rules whose chunks collect contributions in an open round (a RoundT), closed when complete or overdue;
    a closed round's contributions are combined as the protocol's settings say (`--aggregation`)."""

    settings: RoundSettings

    def __init__(self, shard: ShardState, settings: ProtocolSettings) -> None:
        super().__init__(shard, settings)
        self.rounds: dict[int, RoundT] = {c.id: self._new_round() for c in shard.chunks}
        self.started: dict[int, float] = {}

    def _new_round(self) -> RoundT:
        raise NotImplementedError

    def _add(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int) -> None:
        raise NotImplementedError

    def _complete(self, cid: int) -> bool:
        raise NotImplementedError

    def _apply(self, cid: int) -> bool:
        """Hand the closed round to the optimizer; True if the chunk was updated."""
        raise NotImplementedError

    def take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        self.started.setdefault(cid, now)
        self._add(cid, worker, tensor, samples, staleness)
        return self._complete(cid) and self.close(cid)

    def membership_changed(self) -> list[int]:
        """Close the rounds now complete, and every open one once no live worker holds a batch: nobody is left to
        add to it, as when the job's last samples, fewer than a round's, are trained and every worker idles."""
        nobody = not (self.shard.live - self.shard.idle)
        return [cid for cid in self.rounds if self.rounds[cid] and (nobody or self._complete(cid)) and self.close(cid)]

    def overdue(self, now: float, timeout_s: float) -> list[int]:
        """Every open round, once one has waited longer than `timeout_s`.

        A step reaches a shard's chunks in several messages, so their rounds open moments apart. Timed out
        one by one, a late push that arrived in between would join the current round on some chunks and the
        next one on the others: the chunks would stay a round apart for the rest of the job, and every honest
        worker's next pull (which waits for the shard's version, its slowest chunk) would come back before
        its own push's round closed, push into that round again and be refused ("already pushed").
        """
        if not any(now - started > timeout_s for started in self.started.values()):
            return []
        return list(self.started)

    def close(self, cid: int) -> bool:
        if not self.rounds[cid]:
            return False
        updated = self._apply(cid)
        self.rounds[cid] = self._new_round()
        self.started.pop(cid, None)
        return updated

    def _combined(self, cid: int) -> torch.Tensor:
        """Chunk `cid`'s open round, aggregated (aggregation.py)."""
        return aggregate(self.rounds[cid].contributions(), self.settings)


class RoundRule(_RoundRule[SyncRound]):
    """ssgd: each chunk's round waits for every live worker holding a batch, then applies their aggregate once
    (by default the sample-weighted mean).

    A round's gradients are all computed at the round's model: one computed at an
    older version (its worker was left out with batch 0, or late, while the round
    closed without it) is discarded (`max_delay` 1: TOO_STALE, nothing changes)
    and its worker pulls the current model, as rennala's are. Taken, it would
    enter a later round at full weight, and its worker, whose next pull no longer
    waits, would push into that round a second time.
    """

    NAME = "round"

    def max_delay(self) -> int | None:
        return 1

    def chunk_due(self, cid: int, worker: str) -> bool:
        """Not while the chunk's open round holds `worker`'s push: the pull waits for that round to close.

        A worker's pull waits for a version of the whole shard, its least advanced chunk's. Once a chunk is a
        round ahead of the others (a push taken on some chunks of a shard and refused on the others, such as a
        start-up hold decided message by message), the shard's version is reached while the leading chunks'
        rounds still hold the worker's push: sent at once, they would come back at the version it had just
        pushed, and its next push would be refused "already pushed", every step or two for the rest of the job.
        """
        return worker not in self.rounds[cid].parts

    def _new_round(self) -> SyncRound:
        return SyncRound()

    def check(self, worker: str, chunk_ids: list[int]) -> None:
        again = [cid for cid in chunk_ids if worker in self.rounds[cid].parts]
        if again:
            raise ProtocolError(ErrorCode.BAD_STATE, f"{worker} already pushed chunk {again[0]} in this round")

    def _add(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int) -> None:
        self.rounds[cid].add(worker, tensor, samples)

    def _complete(self, cid: int) -> bool:
        return self.rounds[cid].complete(self.shard.live - self.shard.idle)

    def _apply(self, cid: int) -> bool:
        self.shard.apply_step(cid, self._combined(cid))
        return True


class MsyncRule(RoundRule):
    """m-synchronous SGD (the m fastest of each round, as Tyurin and Richtarik 2023 name it): each round applies the
    aggregate of the first m workers' gradients computed at its model (by default their sample-weighted mean);
    the others of that round are discarded as ssgd's late ones are (TOO_STALE, counted in `discarded`), and
    their workers pull the new model. m = 0 waits for every live worker, which is ssgd's round; an m above the
    live workers (some left) is clamped to them, with a line in the shard's log. A chosen worker that leaves
    takes its pushes out of the open rounds, so that its place goes to another on every chunk alike.

    The m workers are chosen on the shard, not chunk by chunk: the first m whose push of a gradient computed at
    version v arrives (any of its chunks) are the round's, and a later one's push of that version is discarded on
    every chunk, even one whose round is still open. A pipelined step pushes a shard's chunks in several
    messages; chosen per chunk, the rounds of different chunks would take different workers, a worker's gradient
    would be taken on some chunks and discarded on others, and its next pull, no longer waiting, would meet its
    own push still in an open round ("already pushed").
    """

    NAME = "msync"
    settings: MsyncSettings
    reached: bool = False  # m workers have been live (fewer before that is the job starting, not a clamp to say)
    clamped: bool = False

    def __init__(self, shard: ShardState, settings: ProtocolSettings) -> None:
        super().__init__(shard, settings)
        self.chosen: dict[int, set[str]] = {}  # the version a round's gradients were computed at -> its workers

    def _needed(self) -> int:
        return self.settings.needed(len(self.shard.live - self.shard.idle))

    def round_full(self, worker: str, base_versions: dict[int, int]) -> bool:
        oldest = min(self.shard.chunk_versions.values())
        self.chosen = {v: workers for v, workers in self.chosen.items() if v >= oldest}
        workers = self.chosen.setdefault(min(base_versions.values()), set())
        if worker not in workers and len(workers) >= self._needed():
            return True
        workers.add(worker)
        return False

    def _complete(self, cid: int) -> bool:
        return len(self.rounds[cid].parts) >= self._needed()

    def membership_changed(self) -> list[int]:
        active = self.shard.live - self.shard.idle
        for workers in self.chosen.values():
            workers &= active  # a chosen worker that left makes room for another, on every chunk
        for cid, open_round in self.rounds.items():
            for gone in open_round.parts.keys() - active:
                del open_round.parts[gone]
            if not open_round:
                self.started.pop(cid, None)
        self.reached = self.reached or len(active) >= self.settings.m
        clamped = self.reached and 0 < len(active) < self.settings.m
        if clamped != self.clamped:
            self.clamped = clamped
            log.warning(
                "msync: %s",
                f"--sync-m {self.settings.m} clamped to the {len(active)} live worker(s)"
                if clamped
                else f"back to --sync-m {self.settings.m} ({len(active)} live workers)",
            )
        return super().membership_changed()


class OuterRule(RoundRule):
    """local and msd: each round aggregates the workers' parameter deltas (by default their sample-weighted
    mean) and applies it with the outer optimizer (plain averaging, or DiLoCo's Nesterov momentum), which is
    the chunks' optimizer under a delta protocol (shard_state.py). A delta is never discarded for its age: it is
    a worker's progress since its last push, whatever model that began from (msd corrects onto the averaged
    model without waiting for it)."""

    NAME = "outer"

    def chunk_due(self, cid: int, worker: str) -> bool:
        """Always: msd pulls while its delta's round is open, and corrects onto the averaged model later."""
        return True

    def max_delay(self) -> int | None:
        return None


class SoftsyncRule(_RoundRule[PooledRound]):
    """n-softsync: an update per floor(workers/n) gradients from anyone, each damped by its staleness: by default
    sum(b_i g_i / max(1, tau_i)) / sum(b_i), the sample-weighted, staleness-damped mean."""

    NAME = "softsync"
    settings: SoftsyncSettings

    def _new_round(self) -> PooledRound:
        return PooledRound()

    def _add(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int) -> None:
        self.rounds[cid].add(worker, tensor, samples, 1.0 / max(1, staleness))

    def _complete(self, cid: int) -> bool:
        return self.rounds[cid].pushes >= softsync_needed(len(self.shard.live), self.settings.n)

    def _apply(self, cid: int) -> bool:
        return self.shard.apply_gradient(cid, self._combined(cid), self.rounds[cid].samples, 1.0)


class RennalaRule(_RoundRule[PooledRound]):
    """Rennala SGD (Tyurin & Richtarik, NeurIPS 2023): each chunk steps once the gradients pushed for its current
    version add up to at least B samples, from whoever delivered them (a fast worker several times); a gradient
    computed at an older version is discarded (`max_delay` 1: TOO_STALE, nothing changes) and its worker pulls
    the current model. A round waits on no worker in particular, so a departure closes it only once no live
    worker holds a batch; one that stays short of B (its contributors left) closes at the round timeout with
    what arrived. A worker's several
    gradients in a round count as one contribution to its aggregate (PooledRound).

    No work is started that the round will not take: a worker's pull is held (parked, like ssp's) while the
    samples already in the round plus those on their way at this version (workers whose pull was answered
    at it and who have not pushed since, each counted at its last push's samples) reach B; it is answered
    with the next version. Without that hold a worker that pushed early would compute again on the model the
    round is about to replace, and its gradient would be discarded as too stale: work started for nothing
    (bench/RESULTS.md 16 has the share of pushed samples discarded with and without the hold).
    """

    NAME = "rennala"
    STREAMS = False  # whether a pull is answered is decided once the whole push is in

    def __init__(self, shard: ShardState, settings: ProtocolSettings) -> None:
        super().__init__(shard, settings)
        self.on_way: dict[str, tuple[int, int]] = {}  # worker -> (version its pull was answered at, samples)
        self.last_samples: dict[str, int] = {}

    def _coming(self) -> int:
        """Samples on their way to this round: workers computing at the current version."""
        version = self.shard.version
        return sum(samples for at, samples in self.on_way.values() if at == version)

    def _in_round(self) -> int:
        return min((r.samples for r in self.rounds.values()), default=0)

    def pull_blocked(self, worker: str) -> bool:
        mine = self.on_way.get(worker)
        if mine is not None and mine[0] == self.shard.version:
            return False  # its gradient for this round is already counted on its way
        return self._in_round() + self._coming() >= self.shard.global_batch

    def admit_pull(self, worker: str) -> bool:
        if self.pull_blocked(worker):
            return False
        self.on_way[worker] = (self.shard.version, self.last_samples.get(worker, 0))
        return True

    def pushed(self, worker: str, samples: int) -> None:
        self.on_way.pop(worker, None)
        self.last_samples[worker] = samples

    def membership_changed(self) -> list[int]:
        for gone in set(self.on_way) - (self.shard.live - self.shard.idle):
            del self.on_way[gone]
        return super().membership_changed()

    def max_delay(self) -> int:
        return 1

    def _new_round(self) -> PooledRound:
        return PooledRound()

    def _add(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int) -> None:
        self.rounds[cid].add(worker, tensor, samples)

    def _complete(self, cid: int) -> bool:
        return self.rounds[cid].samples >= self.shard.global_batch

    def _apply(self, cid: int) -> bool:
        self.shard.apply_step(cid, self._combined(cid))
        return True


RULES: dict[str, type[ShardRule]] = {
    rule.NAME: rule
    for rule in (
        AsyncRule,
        StaleSynchronousRule,
        RingmasterRule,
        RoundRule,
        MsyncRule,
        OuterRule,
        SoftsyncRule,
        RennalaRule,
    )
}
