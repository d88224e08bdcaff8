"""What a worker's or evaluator's report may claim: every number within what is physically possible.

A message that decodes is not yet trusted. A heartbeat's counters only grow, and
by no more than the steps that fit in the time since the last one, each of at
most the job's largest batch; speeds and times are finite and within physical
bounds; an evaluation is of a model version the shards can have reached. A value
out of bounds is refused with a code naming the field, before anything changes,
so the sender's earlier contributions stay as they were. (An evaluation's metric
names and values are bounded by common/wire/eval_bounds.py.)
"""

from __future__ import annotations

import math
from dataclasses import fields

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import EvalReport, ShardHeartbeat, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes

MIN_STEP_S = 1e-4  # no training step, of any model on any machine, takes less
MAX_SECONDS = 86_400.0  # a step (or a phase of one) longer than a day is a lie or a hung process
MIN_SPEED = 1e-3  # samples/s: below this a worker would not finish one batch in a week
MAX_SPEED = 1e9
MAX_PROBLEM_CHARS = 300  # a shard's account of what is wrong with its model (ps/param_guard.py) is one line


def check_worker_heartbeat(
    prev: WorkerHeartbeat, hb: WorkerHeartbeat, elapsed_s: float, max_batch: int, num_shards: int
) -> None:
    """Refuse a worker heartbeat that claims more than it can have done since `prev` (its last accepted one)."""
    seconds = {f"times.{f.name}": getattr(hb.times, f.name) for f in fields(StepTimes)} | {"sync_s": hb.sync_s}
    for name, value in seconds.items():
        if not math.isfinite(value) or not 0.0 <= value <= MAX_SECONDS:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"HEARTBEAT.{name} must be finite, in [0, {MAX_SECONDS:.0f}] s; got {value}"
            )
    if hb.standalone_sps != 0.0 and not MIN_SPEED <= hb.standalone_sps <= MAX_SPEED:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"HEARTBEAT.standalone_sps must be in [{MIN_SPEED}, {MAX_SPEED:.0e}] samples/s; got {hb.standalone_sps}",
        )
    if not math.isfinite(hb.standalone_fixed_s) or not 0.0 <= hb.standalone_fixed_s * hb.standalone_sps <= max_batch:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"HEARTBEAT.standalone_fixed_s {hb.standalone_fixed_s} must be at least 0 and no longer than its probe's "
            f"step (at most --max-batch {max_batch} samples at its standalone speed)",
        )
    if not 0 <= hb.batch <= max_batch:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"HEARTBEAT.batch {hb.batch} is outside [0, {max_batch}] (the job's --max-batch)"
        )
    for name in ("steps", "samples", "bytes", "skipped", "discarded"):
        if getattr(hb, name) < getattr(prev, name):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"HEARTBEAT.{name} went backwards ({getattr(prev, name)} -> "
                f"{getattr(hb, name)}); the counters are cumulative",
            )
    new_steps = hb.steps - prev.steps
    possible = math.floor(max(0.0, elapsed_s) / MIN_STEP_S) + 1
    if new_steps > possible:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"HEARTBEAT.steps grew by {new_steps} in {elapsed_s:.3f} s (at most {possible} steps fit)",
        )
    for name in ("skipped", "discarded"):
        grew = getattr(hb, name) - getattr(prev, name)
        if grew > possible:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"HEARTBEAT.{name} grew by {grew} in {elapsed_s:.3f} s (at most {possible} steps fit)",
            )
    if hb.samples - prev.samples > new_steps * max_batch:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"HEARTBEAT.samples grew by {hb.samples - prev.samples} over {new_steps} "
            f"steps of at most {max_batch} samples",
        )
    if sum(hb.staleness) > hb.steps * num_shards:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"HEARTBEAT.staleness counts {sum(hb.staleness)} updates for {hb.steps} steps on {num_shards} shard(s)",
        )


def check_service_squares(hb: ShardHeartbeat) -> None:
    """Refuse serving seconds' squares that no `served` services summing to `busy_s` can have: their sum lies
    between busy_s^2 / served (all alike) and busy_s^2 (one took it all), and is 0 where none was served."""
    top = hb.busy_s * hb.busy_s if hb.served else 0.0
    least = top / hb.served if hb.served else 0.0
    slack = 1e-9 * top + 1e-12  # the shard sums both in floating point
    if not least - slack <= hb.busy_sq_s <= top + slack:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"SHARD_HEARTBEAT.busy_sq_s {hb.busy_sq_s} is not within what {hb.served} services summing to "
            f"{hb.busy_s} s can square to ({least}..{top})",
        )


def check_shard_heartbeat(hb: ShardHeartbeat, max_rollbacks: int, max_batch: int) -> None:
    """Refuse a shard heartbeat whose version, sample or discard count, serving seconds or transfers are negative
    (a drop is a restart, counted as lost work: lost_work.py), whose transfers are more than its messages can move,
    whose echoed push bounds are not batches of this job, whose list of pushers names a worker twice, or whose
    divergence fields cannot be true: more rollbacks applied than the job allows, a checkpoint version below -1
    (none), an account of its model longer than one line."""
    for name in ("version", "samples", "discarded", "served"):
        if getattr(hb, name) < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"SHARD_HEARTBEAT.{name} must be >= 0, got {getattr(hb, name)}")
    wrong = sorted(w for w, b in (hb.batches or {}).items() if not 0 <= b <= max_batch)
    if wrong:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"SHARD_HEARTBEAT.batches of {wrong[:3]} are not within 0..{max_batch} (--max-batch)"
        )
    for name in ("busy_s", "queued_s", "busy_sq_s", "transfers"):
        if not (math.isfinite(getattr(hb, name)) and getattr(hb, name) >= 0):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"SHARD_HEARTBEAT.{name} must be finite and >= 0, got {getattr(hb, name)}"
            )
    check_service_squares(hb)
    if len(set(hb.pushed)) != len(hb.pushed):
        raise ProtocolError(ErrorCode.BAD_FIELD, "SHARD_HEARTBEAT.pushed names a worker twice")
    if hb.transfers > 2 * hb.served:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"SHARD_HEARTBEAT.transfers {hb.transfers} is more than {hb.served} pulls and pushes can move (two parts "
            "of the model each at most: a push and the pull it carries)",
        )
    check_rollbacks(hb, max_rollbacks)
    if hb.good_version < -1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"SHARD_HEARTBEAT.good_version must be >= -1 (-1: none), got {hb.good_version}"
        )
    if len(hb.model_problem) > MAX_PROBLEM_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"SHARD_HEARTBEAT.model_problem is longer than {MAX_PROBLEM_CHARS} characters"
        )


def check_rollbacks(hb: WorkerHeartbeat | ShardHeartbeat, max_rollbacks: int) -> None:
    """Refuse a heartbeat that acted on more rollbacks than the job allows (--max-rollbacks)."""
    if not 0 <= hb.rollbacks <= max_rollbacks:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{hb.TYPE}.rollbacks {hb.rollbacks} is outside [0, {max_rollbacks}] (--max-rollbacks)"
        )


def check_eval_version(report: EvalReport, newest_possible_version: int) -> None:
    """Refuse an evaluation of a version no shard can have reached (its figures are checked by
    common/wire/eval_bounds.py)."""
    if report.version > newest_possible_version:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"EVAL.version {report.version} is beyond any version the shards can "
            f"have reached ({newest_possible_version})",
        )
