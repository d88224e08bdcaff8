"""The job's settings (`JobConfig`) and the processes' metrics options, as config dataclasses.

Each field is a flag (common/flags.py). The job's settings live with the scheduler
only: workers and shards receive them in WELCOME, so a job is configured in one place.

The schema names its dataset and model choices from common/tasks/catalog.py, not from
the loaders and builders, so reading or validating a job does not load torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynabatch.common.allotment import MIN_BATCH
from dynabatch.common.base_lr import CONSTANT_STEP_LR, DELAY_STEP_LR
from dynabatch.common.flags import ConfigError, changed, opt, typed_values, validate_fields
from dynabatch.common.planning.prediction import PROTOCOLS as MODELLED
from dynabatch.common.planning.protocol_switch import SWITCHABLE, switch_plan
from dynabatch.common.protocols import (
    AGGREGATIONS,
    DBS_WEIGHTS,
    DEFAULT_LOCAL_STEPS,
    DEFAULT_TRIM,
    DELAY_STEP_SAMPLES,
    DELTA,
    PROTOCOLS,
    SPECS,
    STALENESS_STEPS,
)
from dynabatch.common.tasks.catalog import DATASETS, FLAT_PARAMS, MODELS, model_size

if TYPE_CHECKING:
    from dynabatch.optim import OptimizerSpec

BATCH_POLICIES = ("auto", "fixed", "dynamic", "efficient")
AUTO_PROTOCOL = "auto"
PROTOCOL_HELP = (
    f"parameter-server update protocol; {AUTO_PROTOCOL} (the default: no one protocol is fastest on every "
    "cluster): the one of "
    f"{', '.join(SWITCHABLE)} (those "
    "common/planning/prediction.py models but ringmaster, which under auto's delay step only drops the slowest "
    "workers' samples: bench/RESULTS.md 38) predicted to reach the target first, with the batch policy: the job "
    "starts on asgd, and the scheduler chooses once every worker has reported its first steps and again when one "
    "joins, leaves or changes speed, switching the shards and then the workers while the job runs; under auto "
    "asgd takes the delay step (lr / max(1, tau)), so one --lr is about the same step per B "
    "samples under each; with --cluster-profile FILE it is chosen once from the file, before the shards start"
)
PIPELINE_MODES = ("auto", "on", "off")
CHUNK_SCHEDULES = ("fixed", "scheduled")


@dataclass
class JobName:
    """The job's name: the scheduler's, and the one each shard and worker joins (a message of another job is
    refused)."""

    job: str = opt("dynabatch", "the job's name; messages of other jobs are refused", topic="job")


@dataclass
class JobConfig(JobName):
    """What is trained and how: set on the scheduler, sent to every process."""

    dataset: str = opt("fashion-mnist", "training data", DATASETS, topic="data")
    model: str = opt(
        "cnn",
        f"model architecture: {', '.join(MODELS)}; flat:N is one vector of N parameters "
        f"(flat alone: {FLAT_PARAMS}) for the transport benchmarks",
        topic="job",
    )
    protocol: str = opt(AUTO_PROTOCOL, PROTOCOL_HELP, (*PROTOCOLS, AUTO_PROTOCOL), topic="protocol")
    cluster_profile: str = opt(
        "",
        f"--protocol {AUTO_PROTOCOL}: a cluster file (common/planning/cluster_file.py's format, "
        "as `dynabatch plan --profile` "
        "reads and `dynabatch check --save-profile` writes) describing the workers the job will have",
        topic="protocol",
    )
    batch_policy: str = opt(
        "auto",
        "auto (the default): fixed or dynamic, whichever common/planning/prediction.py predicts reaches the target "
        "first on the "
        f"workers' measured step curves and caps ({', '.join(MODELLED)}; other protocols run fixed), chosen once "
        "every worker has reported its first steps and again when one joins, leaves or changes speed: no one "
        "policy was within 1.05x of the best in every regime of bench/RESULTS.md section 14; fixed: B/n per worker; "
        "dynamic: sized by measured speed (DBS-SGD; LB-BSP under ssgd); efficient: each "
        "worker at least at the knee of its own step curve (its fixed cost, transfers included, at most a tenth of "
        "its step) where B allows, the sum kept at B (scheduler/efficient_batches.py)",
        BATCH_POLICIES,
        topic="protocol",
    )
    dbs_weight: str = opt(
        "capped",
        "dynamic batches: how a gradient of b_i samples is weighted; capped: min(1, b_i/(B/n)), never "
        "amplifying one (stable at 64 simulated workers); paper: DBS-SGD's b_i/(B/n), which diverges there "
        "(bench/RESULTS.md section 5)",
        DBS_WEIGHTS,
        topic="protocol",
    )
    staleness_step: str = opt(
        "constant",
        "asgd, ssp, ringmaster: how a gradient's step follows its staleness tau; constant: the same step whatever "
        "tau (ringmaster: its own delay-adaptive min(1, R/2/tau)); delay: lr / max(1, tau), so that the step per B "
        "samples stays about lr however many workers make the gradients stale (ps/step_size.py); --protocol auto "
        "runs delay",
        STALENESS_STEPS,
        topic="protocol",
    )
    delay_step_samples: int = opt(
        DELAY_STEP_SAMPLES,
        "under the delay step, a gradient of b samples takes at most b / this of lr: where a few workers make nearly "
        "every update their gradients are rarely stale, and a small one would otherwise take the whole step "
        "(ps/step_size.py); raise it for a task that wants a smaller step per sample",
        minimum=1,
        topic="protocol",
    )
    shards: int = opt(1, "number of parameter-server shards", minimum=1, topic="cluster")
    max_workers: int = opt(
        256,
        "admit at most this many workers and evaluators at once (a flood of HELLOs "
        "cannot register thousands of members)",
        minimum=1,
        topic="security",
    )
    min_workers: int = opt(
        1,
        "hand out batches only once this many workers have joined (then keep going with "
        "fewer); dynabatch run raises 1 to its --workers, so that every worker starts on the same "
        "model",
        minimum=1,
        topic="cluster",
    )
    global_batch: int = opt(192, "reference global batch B, split across workers", minimum=1, topic="protocol")
    min_batch: int = opt(8, "smallest per-worker batch", minimum=MIN_BATCH, topic="protocol")
    max_batch: int = opt(1024, "largest per-worker batch", minimum=MIN_BATCH, topic="protocol")
    lr: float = opt(
        0.0,
        "base learning rate for a global batch of B; 0 (the default): the step tuned for the step rule that runs, "
        f"{DELAY_STEP_LR:g} under the delay step (--protocol auto, --staleness-step delay), else {CONSTANT_STEP_LR:g} "
        "(common/base_lr.py); a task that names its optimizer sets its own",
        minimum=0.0,
        topic="job",
    )
    momentum: float = opt(
        0.5,
        "SGD momentum on the shards (asynchrony adds implicit momentum, so asgd wants less than 0.9)",
        minimum=0.0,
        below=1.0,
        topic="job",
    )
    weight_decay: float = opt(1e-4, "SGD weight decay on the shards", minimum=0.0, topic="job")
    gradient_bound: float = opt(
        4.0,
        "shards clip each pushed chunk's norm to this many times the workers' typical norm (the lower median of "
        "each worker's recent median), and quarantine a worker clipped push after push; 0: off",
        minimum=0.0,
        topic="security",
    )
    direction_check: bool = opt(
        True,
        "shards score each push by its cosine with the other workers' recent gradients and quarantine a "
        "worker whose pushes keep pointing against them (a sign-flipped liar; ps/gradient_direction.py)",
        topic="security",
    )
    aggregation: str = opt(
        "mean",
        "protocols that close rounds (ssgd, msync, softsync, rennala, local, msd): how shards combine a "
        "round's pushes; mean: weighted by samples; trimmed-mean: per value, drop the --trim fraction of workers at "
        "each end, average the rest by samples; median: per value, the middle worker's (Yin et al. 2018): one lying "
        "worker in a round of 3 or more cannot drag either outside the honest workers' values (ps/aggregation.py)",
        AGGREGATIONS,
        topic="security",
    )
    trim: float = opt(
        DEFAULT_TRIM,
        "--aggregation trimmed-mean: the fraction of a round's workers dropped at each "
        "end of every value, rounded up, below 0.5",
        above=0.0,
        topic="security",
    )
    nesterov: bool = opt(False, "Nesterov momentum on the shards", topic="job")
    epochs: float = opt(
        8.0, "stop after this many passes over the training set (counted from samples)", above=0.0, topic="job"
    )
    time_budget_s: float = opt(
        0.0,
        "also stop this many seconds after training began (0: no limit); benchmarks compare runs at equal time",
        minimum=0.0,
        topic="job",
    )
    pipeline: str = opt(
        "auto",
        "gradient protocols: overlap pulls with forward and pushes with backward, chunk by chunk; auto: on "
        "where the model has several chunks and nothing needs the whole gradient before the first push (not with "
        "--prefetch-pull, a worker's --micro-batch, a task that clips its gradient, or msync), measured in "
        "bench/RESULTS.md 3b",
        PIPELINE_MODES,
        topic="protocol",
    )
    push_pull: bool = opt(
        True,
        "gradient protocols: a push's answer carries the next step's model, one round trip instead of two",
        topic="protocol",
    )
    prefetch_pull: bool = opt(
        False,
        "asgd, softsync: send the next step's pull before computing, so the model arrives during compute "
        "(it then lacks the worker's own last gradient: more staleness)",
        topic="protocol",
    )
    push_behind: bool = opt(
        False,
        "with --prefetch-pull: a push's acknowledgement is awaited only before the next push, so the worker "
        "computes meanwhile (a push the shards refuse fails the step after it)",
        topic="protocol",
    )
    max_inflight_bytes: int = opt(
        8 << 20,
        "credit: gradient bytes a worker may have pushed but not yet acknowledged",
        minimum=1024,
        topic="protocol",
    )
    chunk_bytes: int = opt(1 << 20, "target size of a parameter chunk in bytes", minimum=1024, topic="protocol")
    chunk_schedule: str = opt(
        "fixed",
        "fixed: one chunk per push within --max-inflight-bytes, shards serve by chunk id; scheduled: the "
        "scheduler sets each worker's chunks per push and credit from its measured link and compute, and the "
        "order shards serve workers in (the round's slowest first; asynchronous: the most transfer-bound first); "
        "in a round each worker sends its next pull with its first push",
        CHUNK_SCHEDULES,
        topic="protocol",
    )
    seed: int = opt(0, "seed for model init and data orders", topic="job")
    heartbeat_s: float = opt(0.5, "seconds between heartbeats", minimum=0.01, topic="cluster")
    liveness_timeout_s: float = opt(
        10.0,
        "drop a process whose heartbeats stop for this long (or for three of a worker's own steps, or three "
        "times as long as its recent heartbeats came late, if longer); "
        "a worker or evaluator that registered and never heartbeats is dropped after this long too",
        minimum=0.1,
        topic="cluster",
    )
    join_timeout_s: float = opt(
        120.0,
        "the longest silence a worker's step times can buy; how long a shard may restore its checkpoint "
        "before its first heartbeat, and a stopped job waits for an evaluator to join",
        minimum=0.1,
        topic="cluster",
    )
    reassign_threshold: float = opt(
        0.1,
        "hysteresis: reassign only if some batch changes by more than this fraction",
        minimum=0.0,
        topic="protocol",
    )
    sync_m: int = opt(
        0,
        "msync: a round applies the first m gradients computed at its model and discards the rest "
        "(0: every live worker's, as ssgd; at most --min-workers)",
        minimum=0,
        topic="protocol",
    )
    softsync_n: int = opt(1, "softsync: update after floor(workers / n) gradients", minimum=1, topic="protocol")
    staleness: int = opt(
        3,
        "ssp: a worker's pull waits while it is more than this many steps ahead of the slowest live worker "
        "(0: lock-step like ssgd; large: asgd)",
        minimum=0,
        topic="protocol",
    )
    max_delay: int = opt(
        0,
        "ringmaster: discard a gradient this many or more versions stale (0: the number of live workers)",
        minimum=0,
        topic="protocol",
    )
    local_steps: int = opt(
        DEFAULT_LOCAL_STEPS,
        "local: local steps between syncs; msd: the most local steps (AdaComm's H0)",
        minimum=1,
        topic="protocol",
    )
    outer_lr: float = opt(
        1.0, "local/msd: outer learning rate on the averaged delta (1: plain averaging)", above=0.0, topic="protocol"
    )
    outer_momentum: float = opt(
        0.0, "local/msd: outer momentum (DiLoCo: 0.9 with --outer-lr 0.7)", minimum=0.0, below=1.0, topic="protocol"
    )
    outer_nesterov: bool = opt(True, "local/msd: Nesterov form of the outer momentum", topic="protocol")
    round_timeout_s: float = opt(
        10.0,
        "round protocols (ssgd, msync, softsync, rennala, local, msd): close a round "
        "with what arrived once it has waited this long for workers that have not pushed; a "
        "pull held back (ssp, rennala) is answered after twice this",
        minimum=0.1,
        topic="protocol",
    )
    eval_interval_s: float = opt(
        10.0, "seconds between evaluations of the current model", minimum=0.1, topic="observability"
    )
    await_final_eval: bool = opt(
        False,
        "finish only once an evaluator has evaluated the final model; with none connected, wait up to "
        "--join-timeout-s for one (dynabatch run sets it when it starts an evaluator)",
        topic="observability",
    )
    speed_window: int = opt(16, "step-time observations kept per worker", minimum=2, topic="protocol")
    speed_forgetting: float = opt(0.85, "weight of an observation one step older (0-1)", minimum=0.0, topic="protocol")
    max_rollbacks: int = opt(
        3,
        "a job whose loss or parameters blow up rolls back to its shards' last good checkpoints with half the "
        "step size; after this many rollbacks a further divergence ends it with an error",
        minimum=0,
        topic="job",
    )

    def validate(self) -> None:
        validate_fields(self)
        try:
            model_size(self.model)
        except ValueError as exc:
            raise ConfigError(f"--model: {exc}") from None
        if self.min_batch > self.max_batch:
            raise ConfigError(f"--min-batch {self.min_batch} is larger than --max-batch {self.max_batch}")
        if not 0.0 < self.speed_forgetting <= 1.0:
            raise ConfigError("--speed-forgetting must be in (0, 1]")
        if SPECS.get(self.protocol) is None:
            # auto: from a cluster file, resolved by the scheduler's command (common/planning/auto_protocol.py), or
            # chosen at run time among the protocols the job's flags allow (common/planning/protocol_switch.py)
            if not self.cluster_profile:
                switch_plan(self)
            return
        if self.prefetch_pull and not SPECS[self.protocol].may_prefetch_pull:
            allowed = ", ".join(name for name, spec in SPECS.items() if spec.may_prefetch_pull)
            raise ConfigError(
                f"--prefetch-pull: protocol {self.protocol} does not take a model pulled before the "
                f"worker's own last push (only {allowed} do)"
            )
        if self.push_behind and not self.prefetch_pull:
            raise ConfigError("--push-behind needs --prefetch-pull (otherwise the next pull waits for the push anyway)")
        if self.pipeline == "on" and SPECS[self.protocol].whole_pushes:
            raise ConfigError(
                f"--pipeline on: protocol {self.protocol} takes a worker's gradient whole, not chunk by chunk"
            )
        if self.prefetch_pull and self.pipeline == "on":
            raise ConfigError("--prefetch-pull and --pipeline on overlap the pull in two different ways: choose one")
        SPECS[self.protocol].settings.check(self)

    def pipelines(self, chunks: int, micro_batch: int = 0, clips: bool = False) -> bool:
        """Whether a worker's gradient steps run pipelined, given its model's chunk count, its --micro-batch and
        whether its task clips the gradient.

        `auto` pipelines where it paid in bench/RESULTS.md 3b: a model of one chunk has
        nothing to overlap, and micro-batches, clipping by global norm and a prefetched pull
        all need the whole gradient (or the whole model) before the first push.
        """
        if self.pipeline != "auto":
            return self.pipeline == "on"
        # --protocol auto: the protocol it starts on; a worker steps under the one its WELCOME and assignments name
        spec = SPECS.get(self.protocol) or SPECS[switch_plan(self).start]
        return not spec.whole_pushes and chunks >= 2 and not self.prefetch_pull and not micro_batch and not clips


# The job's settings of the shards' SGD, used where the task names no optimizer (ps/update_rules.optimizer_spec).
SGD_SETTINGS = ("lr", "momentum", "weight_decay", "nesterov")


def check_flags_against_task(job: JobConfig, optimizer: OptimizerSpec | None) -> None:
    """The rule between the job's flags and a task that names its own optimizer; ConfigError in one line if they
    conflict, naming the flags.

    A task's optimizer owns the shards' optimizer, so SGD settings set beside it would be ignored
    (an error, not a silent no-op); under a delta protocol (local, msd) the workers' inner steps are
    SGD from the flags and the shards apply the outer optimizer, so it is the task's optimizer that
    would be ignored (its schedule is not: the inner steps follow it at the job's progress). A flag
    counts as set when its value is not its default: that is all a worker
    can see of the scheduler's flags (it gets the job in WELCOME), so `dynabatch run`, `dynabatch
    check` and every worker decide alike. The scheduler loads no task: with one started by hand, each
    worker (and evaluator) with a --task applies the rule to the job it was sent, and exits 2 saying so.
    No flag conflicts with a task's schedule: it multiplies the shards' base rate, or a delta protocol's inner steps.
    """
    spec = SPECS.get(job.protocol)  # None: auto, told by its shards which delta protocol the task keeps out
    delta = spec is not None and spec.push_kind == DELTA
    if optimizer is None:
        return
    if delta:
        raise ConfigError(
            f"--protocol {job.protocol}: workers step with SGD from --lr, --momentum and "
            f"--weight-decay and the shards apply the outer optimizer, so the task's optimizer "
            f"({optimizer.name}) would not be used; drop it from the task, or choose another protocol"
        )
    given = ["--" + name.replace("_", "-") for name in changed(job, SGD_SETTINGS)]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: the task names the shards' optimizer ({optimizer.name}, lr "
            f"{optimizer.lr:g}); change it in the task, or drop the flag"
        )


@dataclass
class MetricsOptions:
    """Where a process serves /metrics and /healthz."""

    metrics_host: str = opt(
        "127.0.0.1",
        "address for the /metrics and /healthz HTTP server (0.0.0.0: every "
        "interface, for a Prometheus on another machine)",
        topic="observability",
    )
    metrics_port: int = opt(0, "port for /metrics and /healthz (0: any free port)", minimum=0, topic="observability")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict for the wire (WELCOME carries the JobConfig this way)."""
    return dataclasses.asdict(cfg)


def job_from_dict(data: Mapping[str, Any], allow_auto: bool = False) -> JobConfig:
    """Rebuild and validate a JobConfig received on the wire; unknown keys are ignored. A `--protocol auto` the
    scheduler's command did not resolve is refused unless `allow_auto` (a command that resolves it next)."""
    cfg = JobConfig(**typed_values(JobConfig, data, "job setting"))
    cfg.validate()
    if not allow_auto and SPECS.get(cfg.protocol) is None:
        raise ConfigError(
            f"job setting protocol={cfg.protocol!r}: the scheduler's command resolves it before it serves"
        )
    return cfg
