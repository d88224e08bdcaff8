"""The message types of the dynabatch protocol, one dataclass each.

The dataclass fields are the schema: `wire.decode` checks every received envelope
against the annotations here (required fields present, values of the declared
type) before any role looks at it. Fields with defaults are optional on the wire,
so a newer sender may add fields without breaking an older receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from dynabatch.common.wire.step_times import StepTimes


class Role(StrEnum):
    """What a process registers as (HELLO.role): its id (common/wire/member_ids.py), the heartbeat it sends and the
    assignment it gets follow from it. A shard's role is named as its command is (`dynabatch ps`)."""

    WORKER = "worker"
    EVALUATOR = "evaluator"
    SHARD = "ps"


@dataclass
class Hello:
    """A process joins the job: workers and evaluators get an id, shards a slot.

    `instance` is random per process. A HELLO repeated with it (the first answer
    was slow, or HELLOs queued while the scheduler was down) gets the same WELCOME
    again instead of registering a ghost member that a round would wait for.
    `max_batch` is a worker's own largest batch (its memory, `--max-batch`; 0:
    no limit of its own): the scheduler never assigns it more. `slowdown` is a
    worker's emulated slowdown (`--slowdown`, common/slowdown.py's text; "": none
    reported), which STATUS shows beside its name so that a reader can tell the
    workers of an emulated cluster apart.
    """

    TYPE: ClassVar[str] = "HELLO"
    role: Role
    host: str = ""
    metrics_url: str = ""
    endpoint: str = ""
    shard_index: int = -1
    name: str = ""
    instance: str = ""
    max_batch: int = 0
    slowdown: str = ""


@dataclass
class Welcome:
    """The scheduler's answer to HELLO: who you are and the job you are in.

    `number` counts the members of the sender's role as they registered (a shard's is its
    `shard_index`): a worker seeds its own order of the training set with it
    (worker/batch_source.py), so no process reads it back out of `id`.
    """

    TYPE: ClassVar[str] = "WELCOME"
    id: str
    config: dict[str, Any]
    shards: list[str]
    shard_index: int = -1
    number: int = 0


@dataclass
class WorkerHeartbeat:
    """A worker's (or an evaluator's) liveness plus what it did since it registered (cumulative counters).

    Cumulative rather than per-interval so that a lost heartbeat loses no
    samples: the scheduler takes differences itself. `staleness[k]` counts the
    shard updates this worker made that were k versions stale (the last entry
    counts everything at or beyond it), as the shards' PUSH_ACKs reported.
    `times` are of the last step, per step (common/wire/step_times.py): a local
    round's phases are spread over its H steps, so `times.step_s - times.wait_s`
    is always one step of the worker's own work, which is what the scheduler's
    speed model fits. `version` is the model version its last step
    computed on, `assignment_id` the assignment it stepped under, or, while it awaits a
    batch (left out with batch 0, or its allotment trained), the one it holds: the
    scheduler then knows it takes no step under an earlier one. `standalone_sps` and `standalone_fixed_s` are its
    start-up probe (common/probe.py): its speed at the probe's batch and its fixed seconds per step, from a second,
    smaller batch (0: not measured).

    Divergence (scheduler/divergence.py): a worker counts in `skipped` the steps it
    did not push because their loss was not finite, and reports in `rollbacks` the
    last rollback it acted on (it dropped the model it held, and reported the steps
    it had skipped before).

    `discarded` counts the steps whose push its shards answered without applying it
    (too stale for ssgd, msync, ringmaster or rennala; held by the direction check;
    sent across a protocol switch): steps it computed that trained nothing. They are
    progress all the same (scheduler/progress_watch.py): under Ringmaster a worker far
    slower than the rest has every gradient discarded and is not stuck.
    """

    TYPE: ClassVar[str] = "HEARTBEAT"
    steps: int = 0
    samples: int = 0
    batch: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    sync_s: float = 0.0
    bytes: int = 0
    loss: float = float("nan")
    version: int = 0
    standalone_sps: float = 0.0
    assignment_id: int = 0
    staleness: list[int] = field(default_factory=list)
    standalone_fixed_s: float = 0.0
    skipped: int = 0
    rollbacks: int = 0
    discarded: int = 0


@dataclass
class ShardHeartbeat:
    """A shard's liveness plus what only it knows of the model (cumulative since it started, or its checkpoint).

    `version` and `samples` (pushed to it) come back from its checkpoint when it
    restarts, so a drop in them is the work it lost. `membership` is the number of
    the live worker set it has applied (SHARD_ASSIGNMENT's), and `train_size` the
    length of the training set in the model signature the workers initialised it
    with: the scheduler counts epochs from it, and runs no task code to learn it.
    `discarded` counts the pushes its protocol discarded as too stale (ssgd,
    msync, ringmaster, rennala) since it started. `quarantined` lists the workers
    whose pushes it refuses for exceeding the gradient bound again and again
    (ps/gradient_bounds.py): the scheduler drops them.

    Divergence (scheduler/divergence.py): `model_problem` is what its parameter guard
    sees wrong with its model (empty: nothing; ps/param_guard.py), `good_version` the
    version of its last checkpoint of a healthy model (-1: none), and `rollbacks` the
    number of the last rollback it applied (SHARD_ASSIGNMENT's).

    `batches` echoes the push bounds (SHARD_ASSIGNMENT's `batches`) it applied (None: none yet). The scheduler
    hands a worker a larger batch only once every shard reports it: told when the answer was sent, a shard busy
    with a burst of pushes refused the first push of a worker whose answer came after its own.

    `protocol` is the update protocol the shard applies now: under `--protocol auto` the scheduler tells workers a
    new protocol only once every shard reports it (common/planning/protocol_switch.py). `refused_protocol` is one it
    was told to apply and cannot (a task that names the shards' optimizer under a delta protocol): the scheduler
    chooses among the others.

    `busy_s` is the seconds it spent serving pulls and pushes, `queued_s` the seconds those waited at it before
    it began to serve them: the scheduler divides them by the transfers the workers report to learn the shards'
    service time and queue, which `--protocol auto` must tell from each worker's own link
    (scheduler/measured_cluster.py). `served` is how many pulls and pushes it served and `busy_sq_s` the sum of
    the squares of each one's serving seconds: with `busy_s`, the spread of its service time (ps/serving_load.py).
    `transfers` is what they moved in whole parts of the model it holds (a pull or push of all its chunks: 1): its
    service time per transfer is `busy_s` over it, known from its first heartbeat after the first pulls, before any
    worker has reported a step. `pushed` lists the live workers whose push has reached it since it started (read
    off its socket from the worker's own connection): the scheduler times each one's first from the batch it handed
    it, a measure of that worker's link known before its first step ends (scheduler/auto_inputs.py
    `AutoInputs._on_probes`).
    """

    TYPE: ClassVar[str] = "SHARD_HEARTBEAT"
    version: int = 0
    samples: int = 0
    membership: int = 0
    train_size: int = 0
    discarded: int = 0
    quarantined: list[str] = field(default_factory=list)
    model_problem: str = ""
    good_version: int = -1
    rollbacks: int = 0
    batches: dict[str, int] | None = None
    protocol: str = ""
    refused_protocol: str = ""
    busy_s: float = 0.0
    queued_s: float = 0.0
    busy_sq_s: float = 0.0
    served: int = 0
    transfers: float = 0.0
    pushed: list[str] = field(default_factory=list)


@dataclass
class WorkerAssignment:
    """What the scheduler wants a worker (or an evaluator: only `stop`) to do next.

    A worker keeps its last assignment when the scheduler is unreachable. `lr_scale`
    scales its learning rate (DBS-SGD's weight times the job's step-size factor after
    its rollbacks, common/protocols.py). After a divergence the scheduler numbers its
    rollbacks: a worker is given the number in `rollbacks` once every shard has applied
    it, and then drops the model it holds and pulls again. `allotted` is how many
    samples a worker may have trained in all, in its own count (`WorkerHeartbeat.samples`;
    None: no limit): the job's epochs are handed out as such allotments, and a worker
    takes no step beyond its own (common/allotment.py).

    The wire's schedule (scheduler/wire_schedule.py): a worker's pipelined backward batches `chunk_group` of a
    shard's chunks into one PUSH and keeps at most `credit_bytes` unacknowledged (0: the job's one chunk and
    `--max-inflight-bytes`).

    `protocol` is the update protocol the worker steps under from this assignment on ("": the one its WELCOME
    named). Only the scheduler sets it (`--protocol auto`), once every shard applies it; a worker leaves its loop
    at the next step boundary and enters the new protocol's.

    `progress` is how far the job is (epoch / epochs, 0 to 1), as the shards are told it: under a delta protocol
    (local, msd) the worker's own inner steps follow the task's schedule there; a gradient protocol's shards apply it.
    """

    TYPE: ClassVar[str] = "ASSIGNMENT"
    assignment_id: int
    batch: int = 0
    lr_scale: float = 1.0
    local_steps: int = 1
    stop: bool = False
    rollbacks: int = 0
    allotted: int | None = None
    chunk_group: int = 0
    credit_bytes: int = 0
    protocol: str = ""
    progress: float = 0.0


@dataclass
class ShardAssignment:
    """What the scheduler tells a shard of the job: its live workers, their bounds, rollbacks, the stop.

    A shard gets the live workers, numbered by `membership` (it goes up with every join
    and departure): a new worker gets its first batch only once every shard has
    reported applying a set that holds it, so no synchronous round can close
    without a worker whose gradient is already on its way. `allocated` tells a
    shard how many workers hold a batch: DBS-SGD's n (common/protocols.py), and
    `progress` how far the job is (epoch / epochs, 0 to 1): where the task's
    learning-rate schedule stands. `idle_workers` are live workers the scheduler
    left out with batch 0 (a round protocol's slowest): no round waits for them.
    `batches` tells a shard each live worker's largest
    batch (its allocation's, or one it was handed and may still be stepping with):
    a PUSH claiming more samples than that (times the steps a delta covers) is refused.

    After a divergence the scheduler numbers its rollbacks: a shard whose applied
    number is below `rollbacks` restores its last good checkpoint (once per number,
    so a repeated answer changes nothing). `lr_factor` is the job's step-size factor
    after its rollbacks (halved at each); shards multiply their rate by it.
    `hold_checkpoints` asks shards not to checkpoint while workers' losses look diverged.

    A shard serves the messages waiting in one poll, and its parked pulls, by `serve_ranks` (worker -> rank, 0
    first; absent: after every ranked one; scheduler/wire_schedule.py), then front of the model first. Only the
    scheduler's answer carries ranks: nothing a worker sends can change its own.

    `protocol` is the update protocol the shard applies from now on ("": the one its WELCOME named). Under
    `--protocol auto` the scheduler switches the shards first: a shard rebuilds its rule around the same model,
    versions and trust state, and refuses a push made under another protocol (`switched`).
    """

    TYPE: ClassVar[str] = "SHARD_ASSIGNMENT"
    stop: bool = False
    live_workers: list[str] = field(default_factory=list)
    allocated: int = 0
    membership: int = 0
    progress: float = 0.0
    idle_workers: list[str] = field(default_factory=list)
    batches: dict[str, int] = field(default_factory=dict)
    rollbacks: int = 0
    lr_factor: float = 1.0
    hold_checkpoints: bool = False
    serve_ranks: dict[str, int] = field(default_factory=dict)
    protocol: str = ""


Report = TypeVar("Report", WorkerHeartbeat, ShardHeartbeat)
"""A heartbeat, of a worker (or evaluator) or of a shard: each role's is answered by its own `Answer`."""
Answer = TypeVar("Answer", WorkerAssignment, ShardAssignment)


@dataclass
class Init:
    """A worker's model for the shards: its signature, the job's optimizer, and this shard's initial chunks.

    Shards run no user code. The first INIT a shard takes initialises it (unless it
    resumed from a checkpoint); every later one is checked against the signature it
    holds, and a worker whose model differs is refused (`signature`) with the first
    differing parameter named. `names`, `shapes` and `dtypes` list the trainable
    parameters in order; `buffer_names`, `buffer_shapes` and `buffer_dtypes` the
    buffers a training forward changes (BatchNorm's running statistics), which
    shard 0 holds and averages (common/wire/model_signature.py's ModelSignature; absent: none travel),
    and shard 0's INIT carries their initial values as one more chunk entry
    (`BUFFERS_ID`, common/wire/chunking.py). `optimizer` and `schedule` are plain-data specs
    (api/optim.py, api/schedule.py; empty: the job's SGD flags, constant).
    """

    TYPE: ClassVar[str] = "INIT"
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    train_size: int
    optimizer: dict[str, Any] = field(default_factory=dict)
    schedule: dict[str, Any] = field(default_factory=dict)
    buffer_names: list[str] = field(default_factory=list)
    buffer_shapes: list[list[int]] = field(default_factory=list)
    buffer_dtypes: list[str] = field(default_factory=list)


@dataclass
class InitAck:
    """The shard holds a model of this signature; `initialized` if it was this INIT that set it."""

    TYPE: ClassVar[str] = "INIT_ACK"
    version: int
    initialized: bool = False


@dataclass
class Pull:
    """Ask a shard for chunks; with `min_version` the reply waits (ssgd rounds).

    With `buffers` (asked of shard 0 only, when the model has travelling buffers)
    the first PARAMS of the answer also carries the shard's buffers as a chunk
    entry of id `BUFFERS_ID`: they leave when the first chunk does, so a pull
    that waits for a round gets the buffers of that round's pushes.
    """

    TYPE: ClassVar[str] = "PULL"
    ids: list[int] = field(default_factory=list)
    min_version: int = 0
    buffers: bool = False


@dataclass
class Params:
    """Parameter chunks from a shard; each chunk's version is in its chunk entry."""

    TYPE: ClassVar[str] = "PARAMS"
    version: int


@dataclass
class Push:
    """Gradient chunks from a worker, computed on the chunk versions it declares.

    A push to shard 0 of a model with travelling buffers also carries the worker's
    buffers as its last chunk entry (`BUFFERS_ID`): the shard averages their change
    since its last answer to this worker into its own, weighted by `samples`, once
    per model update (ps/shared_buffers.py). They are not a gradient and no update
    rule sees them.

    With `then_pull` the shard also answers with a PULL of all its chunks (at
    `pull_min_version`, and the buffers where it holds them), under the push's seq:
    the model after this push arrives in the same round trip, so a step costs one
    round trip instead of two. Where the protocol allows it (not ssp, not a shard
    holding buffers) each chunk is sent as soon as it is applied, before the
    PUSH_ACK, so sending chunk k overlaps updating chunk k+1.

    `protocol` names the protocol the worker computed the push under ("": not said). It sets nothing: a shard
    refuses a push named for another protocol than its own (`switched`: the scheduler switched the protocol while
    the step was on its way), and the worker pulls and goes on.
    """

    TYPE: ClassVar[str] = "PUSH"
    samples: int
    loss: float = float("nan")
    kind: str = "grad"
    then_pull: bool = False
    pull_min_version: int = 0
    protocol: str = ""


@dataclass
class PushAck:
    """The shard took a push: the version after it and the staleness it measured."""

    TYPE: ClassVar[str] = "PUSH_ACK"
    version: int
    staleness: int = 0
    applied: bool = True


@dataclass
class EvalReport:
    """An evaluator's result on one model version: the loss, and every metric of its task by name.

    `test_acc` is the `accuracy` metric (NaN when the task does not compute one); every other value is finite
    (common/wire/eval_bounds.py).
    """

    TYPE: ClassVar[str] = "EVAL"
    version: int
    test_loss: float
    test_acc: float
    final: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StatusRequest:
    """Ask the scheduler for the job's state (used by `dynabatch run` and tests)."""

    TYPE: ClassVar[str] = "STATUS"


@dataclass
class WorkerStatus:
    """One live worker in STATUS: who it is, its last step (`times`, its heartbeat's), and its running totals.

    The totals (`step_s_total` and `data_s_total` over `observed_steps`,
    `observed_samples` over `compute_s_total`) let a reader average over any
    stretch of the run from two snapshots, however often it sampled. `max_batch`
    is the worker's own largest batch from its HELLO (0: none), `slowdown` its
    emulated slowdown from its HELLO ("": none reported). `chunk_group`, `credit_bytes` and `wire_reason` are
    how it sends its gradient and why, `serve_rank` the order shards serve it in (-1: unranked), from
    scheduler/wire_schedule.py. `idle` says why the scheduler gives it no batch while it stays registered
    ("": it is not idle), e.g. Ringmaster would discard every step it took (scheduler/idle_workers.py);
    `discarded` counts its steps whose push the shards answered without applying it (its heartbeat's).
    `standalone_sps` and `standalone_fixed_s` are its start-up probe's speed and fixed seconds per step, as it
    reported them (what the scheduler's first split and the efficient policy's fixed part start from).
    """

    role: str = "worker"
    name: str = ""
    host: str = ""
    metrics_url: str = ""
    joined: float = 0.0
    steps: int = 0
    samples: int = 0
    batch: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    samples_per_s: float = 0.0
    standalone_sps: float = 0.0
    standalone_fixed_s: float = 0.0
    loss: float | None = None
    step_s_total: float = 0.0
    observed_steps: int = 0
    compute_s_total: float = 0.0
    observed_samples: int = 0
    version: int = 0
    endpoint: str = ""
    data_s_total: float = 0.0
    max_batch: int = 0
    slowdown: str = ""
    chunk_group: int = 1
    credit_bytes: int = 0
    wire_reason: str = ""
    serve_rank: int = -1
    idle: str = ""
    discarded: int = 0


@dataclass
class ShardStatus:
    """One registered shard in STATUS, as its last heartbeat told the scheduler (`model_problem`: what its
    parameter guard finds wrong, empty if nothing; `good_version`: its last checkpoint of a healthy model;
    `busy_s` and `queued_s`: its seconds serving pulls and pushes and their wait before it, since it started, so
    that a reader of two snapshots has the shard's service time over any stretch of the run; `served` and
    `busy_sq_s`: how many it served and the sum of their serving seconds' squares, for that time's spread;
    `transfers`: what they moved, in whole parts of its model; `pushed`: how many live workers' pushes have reached
    it, which `--protocol auto`'s choice before the first step waits for)."""

    endpoint: str
    version: int
    metrics_url: str
    discarded: int = 0  # pushes discarded as too stale (ssgd, msync, ringmaster, rennala)
    model_problem: str = ""
    good_version: int = -1
    busy_s: float = 0.0
    queued_s: float = 0.0
    busy_sq_s: float = 0.0
    served: int = 0
    transfers: float = 0.0
    pushed: int = 0


@dataclass
class Decision:
    """One change of the batch allocation (or of H) and why it happened; `subject` is the worker behind it."""

    t: float
    reason: str
    subject: str
    batches: dict[str, int]
    predicted_step_s: dict[str, float]


@dataclass
class Rollback:
    """A divergence the job recovered from (or tried to): when, why, to which versions, at which step size.

    `number` counts the job's rollbacks from 1; `versions` is each shard's version
    (by shard index): the last good checkpoint it reported when the rollback was
    ordered, then the version it restored, once it has (`done` once every shard has);
    `lr_factor` is the job's step-size factor from then on.
    """

    number: int
    t: float
    epoch: float
    cause: str
    versions: dict[str, int]
    lr_factor: float
    done: bool = False


@dataclass
class DecisionLatency:
    """Seconds the scheduler took to handle a heartbeat, over its recent ones (None before the first)."""

    count: int = 0
    mean: float | None = None
    p99: float | None = None


@dataclass
class DepartedWorker:
    """A worker that left or was dropped, in STATUS: its name and its totals as its last accepted heartbeat told
    them. A worker's last step and its BYE often fall between two of `dynabatch run`'s snapshots, which would
    otherwise never show that step's samples."""

    name: str = ""
    steps: int = 0
    samples: int = 0
    discarded: int = 0


@dataclass
class JobStatus:
    """The job as the scheduler sees it at scheduler time `t` (seconds since it started).

    Times ending in `_t` are on the same clock; None means not yet (no training,
    no evaluation, no finite loss). `metrics` are the latest evaluation's, by name
    (its loss included); `train_size` is the training set's length as the shards'
    model signature gives it (0 until a worker has initialised them). `decision_s`
    is the server's own figure,
    filled in as it answers STATUS. `samples` counts every sample trained;
    `lost_samples` those whose updates shards lost in restarts (`lost_versions`
    updates), which the job trains again: `epoch` counts the samples the model holds.
    `unallotted` is what the job's budget (its epochs' samples) has yet to allot to workers (None: the budget is
    not known yet); at 0 the last batches are sized to what each worker's allotment leaves.
    `auto_policy` is the policy `--batch-policy auto` runs now and `auto_reason` why ("" under another policy).
    Under `--protocol auto`, `protocol` is the one the workers step under now, `auto_protocol` the one chosen (the
    shards take it first) and `auto_protocol_reason` why ("" under a protocol given by name).
    `workers` are the live workers, `departed` those that left or were dropped, with their final totals.
    `dynabatch run` writes these snapshots, as maps with the field names as keys, to the run folder's timeline.json.
    """

    t: float
    job: str = ""
    protocol: str = ""
    batch_policy: str = ""
    epoch: float = 0.0
    target_epochs: float = 0.0
    samples: int = 0
    bytes: int = 0
    staleness: list[int] = field(default_factory=list)
    training_t: float | None = None
    budget_spent: bool = False
    local_steps: int = 1
    local_steps_reason: str = ""
    loss: float | None = None
    test_acc: float | None = None
    test_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    train_size: int = 0
    eval_version: int | None = None
    eval_t: float | None = None  # when the evaluation was reported
    eval_model_t: float | None = None  # when the model it evaluated existed at the shards
    stopping: bool = False
    finished: bool = False
    final_eval: bool = False
    final_eval_given_up: str = ""  # why a finished job has no final evaluation where one was awaited ("" if not)
    assignment_id: int = 0
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    departed: dict[str, DepartedWorker] = field(default_factory=dict)
    shards: dict[str, ShardStatus] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    decision_s: DecisionLatency = field(default_factory=DecisionLatency)
    lost_samples: int = 0
    lost_versions: int = 0
    rollbacks: list[Rollback] = field(default_factory=list)
    lr_factor: float = 1.0
    failed: str = ""
    unallotted: int | None = None
    auto_policy: str = ""
    auto_reason: str = ""
    auto_protocol: str = ""
    auto_protocol_reason: str = ""


@dataclass
class StatusReply:
    """The job's state as the scheduler sees it; see scheduler/job_state.py."""

    TYPE: ClassVar[str] = "STATUS_REPLY"
    state: JobStatus


@dataclass
class Bye:
    """A process leaves on purpose, so its share moves at once, not after a timeout.

    The scheduler answers BYE_ACK. Messages on one connection arrive in order,
    so the acknowledgement also confirms the last HEARTBEAT and EVAL sent before
    it: a worker that stops by itself (ssgd) or an evaluator's final report must
    not be lost to a process exiting with unsent messages in its queue.
    """

    TYPE: ClassVar[str] = "BYE"


@dataclass
class ByeAck:
    """The scheduler took a BYE (and so everything the process sent before it)."""

    TYPE: ClassVar[str] = "BYE_ACK"


@dataclass
class Error:
    """The answer to a message that was rejected (its envelope seq is the offender's)."""

    TYPE: ClassVar[str] = "ERROR"
    code: str
    text: str


MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        WorkerHeartbeat,
        ShardHeartbeat,
        WorkerAssignment,
        ShardAssignment,
        Init,
        InitAck,
        Pull,
        Params,
        Push,
        PushAck,
        EvalReport,
        StatusRequest,
        StatusReply,
        Bye,
        ByeAck,
        Error,
    )
}
