"""Every update protocol, described once: the table every role reads.

A role looks its protocol up here and never compares the protocol's name: the
shard takes its update rule from `shard_rule` (ps/protocol_rules.py), the worker
its step planner from `worker_loop` (worker/step_plans.py, which the worker's
loops and the simulator both run), and the scheduler what it decides from the
flags below. Each flag is read where it matters by every role and tool that
needs it, never restated (the shard rule's ONE_PER_ROUND is derived from
`one_push_per_round`). Adding a protocol is one
`ProtocolSpec` here, one shard rule, one step planner and its worker loop (or the
reuse of one), and their tests.

A protocol's own settings (`ProtocolSettings`, one class per protocol that has
any) are named by its spec and built from the job's flags by `protocol_settings`:
the flags keep their names on the command line, and the shard rule reads its
settings object, never another protocol's flags.

This module imports nothing heavy: `dynabatch keys` and the job schema read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from dynabatch.common.flags import ConfigError, changed

if TYPE_CHECKING:
    from dynabatch.common.config import JobConfig

GRADIENT = "grad"
DELTA = "delta"


@dataclass(frozen=True)
class ProtocolSettings:
    """What a protocol's shard rule reads besides the shard itself; this base is a protocol with none."""

    # The job's fields (flags) the settings' fields are built from, one per field in `dataclasses.fields` order.
    FLAGS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_job(cls, job: JobConfig) -> ProtocolSettings:
        """The settings from the job's flags (the flags keep their names; each belongs to one protocol)."""
        return cls(**{f.name: getattr(job, flag) for f, flag in zip(dataclasses.fields(cls), cls.FLAGS, strict=True)})

    @classmethod
    def check(cls, job: JobConfig) -> None:
        """Refuse (ConfigError, one line) what the job's flags ask of this protocol that it cannot do.

        This base is a protocol that applies each push on its own and closes no rounds, so there is
        nothing for `--aggregation` or `--trim` to combine: set, they would be ignored.
        """
        if job.aggregation != "mean" or job.trim != DEFAULT_TRIM:
            flag = f"--aggregation {job.aggregation}" if job.aggregation != "mean" else f"--trim {job.trim:g}"
            rounds = ", ".join(name for name, spec in SPECS.items() if spec.closes_rounds)
            raise ConfigError(
                f"{flag}: protocol {job.protocol} applies each push on its own and closes no rounds "
                f"to aggregate (only {rounds} do)"
            )


AGGREGATIONS: tuple[str, ...] = ("mean", "trimmed-mean", "median")
"""How a closed round's contributions become one update (`--aggregation`, ps/aggregation.py): the sample-weighted
mean, or the coordinate-wise trimmed mean or median of Yin et al. (ICML 2018), which one Byzantine worker in a
round of three or more cannot drag outside the honest workers' values."""
DEFAULT_TRIM = 0.2


@dataclass(frozen=True)
class RoundSettings(ProtocolSettings):
    """How a protocol that closes rounds combines a round's contributions: `aggregation` (AGGREGATIONS) and,
    for the trimmed mean, the fraction `trim` of workers dropped at each end of every coordinate
    (--aggregation, --trim).

    Keyword-only, so that a protocol's own settings keep their positions before them.
    """

    FLAGS: ClassVar[tuple[str, ...]] = ("aggregation", "trim")
    aggregation: str = field(default="mean", kw_only=True)
    trim: float = field(default=DEFAULT_TRIM, kw_only=True)

    @classmethod
    def check(cls, job: JobConfig) -> None:
        """A trim is a fraction of each end below one half (at least one value is kept), and only the trimmed
        mean reads it."""
        if not job.trim < 0.5:
            raise ConfigError(f"--trim: {job.trim:g} must be below 0.5 (a fraction of the workers dropped at each end)")
        if job.trim != DEFAULT_TRIM and job.aggregation != "trimmed-mean":
            raise ConfigError(f"--trim {job.trim:g}: only --aggregation trimmed-mean reads it, not {job.aggregation}")


@dataclass(frozen=True)
class SoftsyncSettings(RoundSettings):
    """n-softsync's n: an update waits for floor(workers / n) gradients (--softsync-n)."""

    FLAGS = (*RoundSettings.FLAGS, "softsync_n")
    n: int = 1


@dataclass(frozen=True)
class MsyncSettings(RoundSettings):
    """m-synchronous SGD's m: a round takes the first m gradients computed at its model (--sync-m; 0: every live
    worker's, which is ssgd's round)."""

    FLAGS = (*RoundSettings.FLAGS, "sync_m")
    m: int = 0

    def needed(self, live_workers: int) -> int:
        """The gradients a round takes: m, or every live worker where m is 0 or more than are live (at least 1)."""
        return max(1, min(self.m or live_workers, live_workers))

    @classmethod
    def check(cls, job: JobConfig) -> None:
        """m is at most the workers the job starts with (--min-workers; `dynabatch run`: --workers), so that its
        first round can close with m gradients of m different workers."""
        super().check(job)
        if job.sync_m > job.min_workers:
            raise ConfigError(
                f"--sync-m {job.sync_m}: a round takes the first m gradients of m different workers, "
                f"and the job starts with {job.min_workers} worker(s) (--min-workers; dynabatch run: "
                f"--workers): choose m between 1 and {job.min_workers}, or 0 for every live worker"
            )


DEFAULT_LOCAL_STEPS = 8
"""H, the local steps a `local` worker takes between pushes unless --local-steps says otherwise (msd's most)."""

STALENESS_STEPS: tuple[str, ...] = ("constant", "delay")
"""How an asynchronous gradient's step follows its staleness tau (`--staleness-step`, ps/step_size.py): `constant`
takes the same step whatever tau; `delay` divides it by max(1, tau), and a gradient of b samples takes at most
b / --delay-step-samples of it."""

DELAY_STEP_SAMPLES = 64
"""`--delay-step-samples`' default: the least samples a gradient needs to take the whole of the delay step's lr, the
main job's per-worker batch, so that neither its tuned step (bench/RESULTS.md 29) nor any regime file's moves."""


@dataclass(frozen=True)
class AsyncSettings(ProtocolSettings):
    """asgd's step against staleness, `staleness_step` (STALENESS_STEPS, --staleness-step) and the delay step's
    per-sample bound (--delay-step-samples); keyword-only, so that a protocol that extends it keeps its own settings'
    positions."""

    FLAGS: ClassVar[tuple[str, ...]] = ("staleness_step", "delay_step_samples")
    staleness_step: str = field(default="constant", kw_only=True)
    delay_step_samples: int = field(default=DELAY_STEP_SAMPLES, kw_only=True)


@dataclass(frozen=True)
class SspSettings(AsyncSettings):
    """ssp's bound: a worker more than `staleness_bound` clocks ahead of the slowest has its pulls held
    (--staleness); its gradients are asgd's, so it takes asgd's step against staleness too."""

    FLAGS = (*AsyncSettings.FLAGS, "staleness")
    staleness_bound: int = 3


@dataclass(frozen=True)
class RingmasterSettings(AsyncSettings):
    """Ringmaster ASGD's delay threshold R (--max-delay; 0: the number of live workers), and its step against
    staleness (--staleness-step: `constant`, its own delay-adaptive step; `delay`, asgd's lr / max(1, tau), the
    step `--protocol auto` gives asgd, so that one --lr means the same step under both).

    A gradient whose staleness reaches R is discarded. Why R = n by default: with n
    workers stepping asynchronously, a gradient is on average about n - 1 versions
    stale (every other worker's push lands once while it computes, whatever the
    speeds, as the simulator's asgd shows), so R = n keeps the gradients of every
    worker that is about as fast as the cluster's average and drops only those of
    workers slower than that, whose stale gradients are what makes asgd unstable at
    scale; it follows the cluster as workers join and leave, with no tuning.
    """

    FLAGS = (*AsyncSettings.FLAGS, "max_delay")
    max_delay: int = 0

    def threshold(self, live_workers: int) -> int:
        """R: the configured one, or the number of live workers (at least 1)."""
        return self.max_delay or max(1, live_workers)


@dataclass(frozen=True)
class OuterSettings(RoundSettings):
    """The outer optimizer of the delta protocols (local, msd): --outer-lr, --outer-momentum, --outer-nesterov;
    its input is the round's aggregated delta.

    lr 1 and momentum 0 is plain model averaging; DiLoCo uses lr 0.7 with
    Nesterov momentum 0.9.
    """

    FLAGS = (*RoundSettings.FLAGS, "outer_lr", "outer_momentum", "outer_nesterov")
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True


@dataclass(frozen=True)
class ProtocolSpec:
    """What a protocol is, for every role that runs it.

    - `push_kind`: what a worker pushes, gradients or parameter deltas.
    - `shard_rule`: the shard's rule class (`ShardRule.NAME` in ps/protocol_rules.py).
    - `worker_loop`: the worker's step planner (a key of worker/step_plans.py `PLANS`): gradient, local or msd.
    - `one_push_per_round`: a worker may push each chunk once per round, and a
      round waits on every live worker (msync: on the first m); a gradient
      worker's next pull waits for the round its push went into.
    - `held_pull_waits`: the shard holds a gradient worker's pull until the next
      round's model (rennala), so that time is waiting for others, not pulling.
    - `local_steps`: workers take H local steps per push (the assignment's H).
    - `adaptive_local_steps`: the scheduler adapts H as the loss falls (AdaComm).
    - `overlaps_rounds`: a worker keeps stepping while its delta is averaged, so one
      push may cover more than H local steps (msd).
    - `may_prefetch_pull`: a worker may send the next step's pull before this step's
      compute (`--prefetch-pull`), so the model arrives while it computes; it then
      computes on a model without its own last gradient. Only protocols that take
      any staleness (asgd) or damp it (softsync) allow it.
    - `sized_rounds`: an update waits for B samples at one model version, so the
      scheduler sizes batches as for a synchronous round (a worker whose fixed
      cost alone exceeds the round gets none), though the round waits on no one.
    - `equal_steps`: a worker whose step is longer than the others' costs the job
      more than its own samples: a round waits for it (ssgd, local, msd, rennala),
      msync drops its gradients once m others have arrived,
      ssp holds the others back once they are `--staleness` clocks ahead of it, and
      ringmaster discards its gradients, whose staleness reaches the live workers'
      number as soon as its step is longer than theirs. So the scheduler's dynamic
      batches give every worker the same step time. Where it is False (asgd,
      softsync) nobody waits and nothing is discarded for being slow, and batches
      follow each worker's compute speed instead (scheduler/batch_allocation.py,
      `allocate_compute`), so a slow link does not shrink a worker's batch.
    - `whole_pushes`: a shard judges a worker's gradient whole (msync's round takes the first m workers'
      gradients of its model, and a worker's pull after a discarded one must not mix the rounds' chunks), so
      the worker's step is not pipelined chunk by chunk (`--pipeline`).
    - `first_pushes`: a round closes on the first pushes of its model (msync's m), dropping the rest, not on
      every live worker's, so its workers do not move in lockstep (`lockstep`).
    - `settings`: the class of the protocol's own settings (`protocol_settings` builds them); a protocol
      that closes rounds has RoundSettings among them (`closes_rounds`).
    """

    name: str
    summary: str
    push_kind: str
    shard_rule: str
    worker_loop: str
    one_push_per_round: bool = False
    held_pull_waits: bool = False
    local_steps: bool = False
    adaptive_local_steps: bool = False
    overlaps_rounds: bool = False
    may_prefetch_pull: bool = False
    sized_rounds: bool = False
    equal_steps: bool = False
    whole_pushes: bool = False
    first_pushes: bool = False
    settings: type[ProtocolSettings] = ProtocolSettings

    @property
    def lockstep(self) -> bool:
        """Every round takes one push of every live worker (ssgd, local, msd): the workers move from round to
        round together, so the job's last samples must end them at the same round."""
        return self.one_push_per_round and not self.first_pushes

    @property
    def closes_rounds(self) -> bool:
        """Whether the shard combines several pushes into one update (a round), which `--aggregation` chooses how."""
        return issubclass(self.settings, RoundSettings)

    def report_steps(self, local_steps: int) -> int:
        """The local steps one reported step covers, at the assignment's `local_steps`: a local round's H (its
        worker reports the round at its end), 1 otherwise (msd reports each local step as it takes it)."""
        return max(1, local_steps) if self.local_steps and not self.overlaps_rounds else 1


SPECS: dict[str, ProtocolSpec] = {
    spec.name: spec
    for spec in (
        ProtocolSpec(
            "asgd",
            "asynchronous: every gradient applied on arrival (Downpour); with dynamic batches, DBS-SGD",
            GRADIENT,
            shard_rule="async",
            worker_loop="gradient",
            may_prefetch_pull=True,
            settings=AsyncSettings,
        ),
        ProtocolSpec(
            "ssgd",
            "bulk synchronous: one sample-weighted mean per round of every live worker",
            GRADIENT,
            shard_rule="round",
            worker_loop="gradient",
            one_push_per_round=True,
            sized_rounds=True,
            equal_steps=True,
            settings=RoundSettings,
        ),
        ProtocolSpec(
            "msync",
            "m-synchronous SGD: each round applies the mean of the first --sync-m gradients "
            "computed at its model; the rest of the round are discarded",
            GRADIENT,
            shard_rule="msync",
            worker_loop="gradient",
            one_push_per_round=True,
            equal_steps=True,
            whole_pushes=True,
            first_pushes=True,
            settings=MsyncSettings,
        ),
        ProtocolSpec(
            "softsync",
            "n-softsync: the staleness-damped mean of floor(workers/n) gradients from anyone",
            GRADIENT,
            shard_rule="softsync",
            worker_loop="gradient",
            may_prefetch_pull=True,
            settings=SoftsyncSettings,
        ),
        ProtocolSpec(
            "ssp",
            "stale-synchronous parallel: asynchronous, but no worker pulls more than "
            "--staleness clocks ahead of the slowest",
            GRADIENT,
            shard_rule="ssp",
            worker_loop="gradient",
            equal_steps=True,
            settings=SspSettings,
        ),
        ProtocolSpec(
            "ringmaster",
            "Ringmaster ASGD: asynchronous, a gradient --max-delay or more versions stale is "
            "discarded and its worker re-pulls; the others take a delay-adaptive step",
            GRADIENT,
            shard_rule="ringmaster",
            worker_loop="gradient",
            equal_steps=True,
            settings=RingmasterSettings,
        ),
        ProtocolSpec(
            "rennala",
            "Rennala SGD: one step per B samples of gradients computed at the current model, "
            "from whoever delivers them; a gradient of an older model is discarded",
            GRADIENT,
            shard_rule="rennala",
            worker_loop="gradient",
            held_pull_waits=True,
            sized_rounds=True,
            equal_steps=True,
            settings=RoundSettings,
        ),
        ProtocolSpec(
            "local",
            "local SGD: H local steps, then the sample-weighted mean delta via an outer optimizer",
            DELTA,
            shard_rule="outer",
            worker_loop="local",
            one_push_per_round=True,
            local_steps=True,
            equal_steps=True,
            settings=OuterSettings,
        ),
        ProtocolSpec(
            "msd",
            "multi-step delay: local SGD that never waits, corrects onto the averaged model, H adapted (AdaComm)",
            DELTA,
            shard_rule="outer",
            worker_loop="msd",
            one_push_per_round=True,
            local_steps=True,
            adaptive_local_steps=True,
            overlaps_rounds=True,
            equal_steps=True,
            settings=OuterSettings,
        ),
    )
}
PROTOCOLS: tuple[str, ...] = tuple(SPECS)


def protocol_spec(name: str) -> ProtocolSpec:
    """The spec of protocol `name`; ValueError naming the known ones otherwise."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}") from None


def protocol_settings(job: JobConfig) -> ProtocolSettings:
    """The job's protocol's own settings, from the job's flags."""
    return protocol_spec(job.protocol).settings.from_job(job)


def refuse_unread_settings(job: JobConfig) -> None:
    """Refuse (ConfigError, one line) a setting that only other protocols read (their `ProtocolSettings.FLAGS`, and
    --cluster-profile, which only `--protocol auto` reads) given away from its default to a job of a named protocol:
    it would be ignored without a word (`--sync-m 2 --protocol asgd`).

    The commands a user types call this (`dynabatch run`, `dynabatch scheduler`), not `JobConfig.validate`: a job
    of `--protocol auto` may run any protocol and keeps the settings given for the others, also once the job on
    the wire names the one auto chose."""
    spec = SPECS.get(job.protocol)
    if spec is None:
        return
    readers: dict[str, list[str]] = {"cluster_profile": ["auto"]}
    for name, other in SPECS.items():
        for flag in other.settings.FLAGS:
            readers.setdefault(flag, []).append(name)
    for flag in changed(job, [f for f in readers if f not in spec.settings.FLAGS]):
        raise ConfigError(
            f"--{flag.replace('_', '-')} {getattr(job, flag)}: only --protocol {' or '.join(readers[flag])} reads "
            f"it, not {job.protocol}; drop it"
        )


DBS_WEIGHTS: tuple[str, ...] = ("capped", "paper")
"""How a gradient of b_i samples is weighted under dynamic batches (`--dbs-weight`): `paper` is DBS-SGD's
b_i / (B/n) (Ji et al. 2019), which multiplies the step of the largest batches, and so of the fastest workers'
equally stale gradients, by up to about 4 and blows up at 64 simulated workers; `capped` is min(1, b_i / (B/n)),
which weighs a gradient by its samples and never amplifies one (bench/RESULTS.md section 5)."""


def dbs_weight(samples: int, global_batch: int, allocated_workers: int, rule: str = "capped") -> float:
    """DBS-SGD's weight for a gradient of `samples` samples under `rule` (DBS_WEIGHTS), n the workers holding a batch.

    The one rule for both owners of the weight: the scheduler's learning-rate scale
    for a worker's own optimizer (local, msd) and the shard's scale for a pushed
    gradient. n counts the workers the scheduler allocated a batch to, not those
    merely registered, so a worker that is joining and has no batch yet changes
    nothing; under the fixed policy every b_i is B/n and the weight is 1 under either rule.
    """
    weight = samples * max(1, allocated_workers) / global_batch
    if rule == "paper":
        return weight
    if rule == "capped":
        return min(1.0, weight)
    raise ValueError(f"unknown DBS weight rule {rule!r}; choose one of {', '.join(DBS_WEIGHTS)}")
