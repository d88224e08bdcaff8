"""Turning per-worker speed models into per-worker batch sizes.

All functions are pure and deterministic: ties are broken by worker id, so two
schedulers (or a restarted one) given the same inputs hand out the same batches.

Bounds are per worker: the job's ``[b_min, b_max]``, and below ``b_max`` a
worker's own largest batch (``caps``, declared in its HELLO: machines differ in
memory, not only in speed). A cap is physical, so it also wins over ``b_min``:
a worker that can hold 4 samples gets at most 4 even if the job's smallest
batch is 8.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dynabatch.common.protocols import ProtocolSpec
from dynabatch.scheduler.speed_model import StepModel


def _check_bounds(global_batch: int, b_min: int, b_max: int) -> None:
    if global_batch < 0:
        raise ValueError(f"global_batch must be >= 0, got {global_batch}")
    if b_min < 1:
        raise ValueError(f"b_min must be >= 1, got {b_min}")
    if b_max < b_min:
        raise ValueError(f"b_max ({b_max}) must be >= b_min ({b_min})")


def _worker_bounds(
    ids: Sequence[str], b_min: int, b_max: int, caps: Mapping[str, int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each worker's ``(lowest, highest)`` batch: ``hi = min(b_max, cap)``, ``lo = min(b_min, hi)``."""
    caps = caps or {}
    bad = {w: c for w, c in caps.items() if c < 1}
    if bad:
        raise ValueError(f"caps must be >= 1, got {bad}")
    hi = np.array([min(b_max, caps.get(w, b_max)) for w in ids], dtype=np.int64)
    return np.minimum(b_min, hi), hi


def _infeasible(ids: Sequence[str], global_batch: int, lo: np.ndarray, hi: np.ndarray) -> dict[str, int] | None:
    """Everyone at the violated bound when ``global_batch`` is outside ``[sum lo, sum hi]``.

    This is not an error: the configuration is validated up front, but workers
    joining or leaving at runtime (or declaring small caps) can make the bounds
    infeasible, and the job must go on. The per-worker bounds win over the
    global batch, whose sum then differs (``bounds_note`` says so).
    """
    if global_batch <= int(lo.sum()):
        return {w: int(b) for w, b in zip(ids, lo, strict=True)}
    if global_batch >= int(hi.sum()):
        return {w: int(b) for w, b in zip(ids, hi, strict=True)}
    return None


def bounds_note(batches: Mapping[str, int], global_batch: int) -> str:
    """ "" when ``batches`` sum to ``global_batch``; else a bounded label saying which bounds won.

    It becomes part of a decision's reason (a Prometheus label), so it names no numbers;
    the decision's batches show the sum.
    """
    total = sum(batches.values())
    if not batches or total == global_batch:
        return ""
    return "bounds hold less than B" if total < global_batch else "bounds hold more than B"


def _largest_remainder(ids: Sequence[str], shares: np.ndarray, total: int) -> dict[str, int]:
    """Round ``shares`` (summing to ``total``) to integers that sum to ``total`` exactly.

    Each share is rounded down and the missing units go to the largest fractional
    parts, first worker id first among equal ones; no share moves by a whole
    sample, so integer bounds the shares respect stay respected.
    """
    floors = np.floor(shares)
    rounded = floors.astype(np.int64)
    missing = total - int(rounded.sum())
    order = np.argsort(-(shares - floors), kind="stable")
    rounded[order[:missing]] += 1
    return {worker: int(x) for worker, x in zip(ids, rounded, strict=True)}


def allocate(
    models: Mapping[str, StepModel],
    global_batch: int,
    b_min: int,
    b_max: int,
    caps: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Batch sizes giving every worker the same predicted step time, summing to ``global_batch``.

    Unconstrained, ``a_i + c_i*b_i = T`` for all i and ``sum b_i = B`` give
    ``T = (B + sum a_i/c_i) / sum(1/c_i)`` and ``b_i = (T - a_i)/c_i``. With bounds,
    workers whose share falls outside their bounds ``[lo_i, hi_i]`` (the job's
    ``[b_min, b_max]``, with ``caps`` lowering a worker's upper bound, see the
    module's docstring) are pinned there and the others re-solved with the rest
    of the batch. Pinning and re-solving in rounds can pin a worker too early
    when some hit the lower bound and others the upper one in the same round, so
    the fixed point of that process is computed directly instead:
    ``sum clip((T - a_i)/c_i, lo_i, hi_i)`` is continuous and
    nondecreasing in ``T`` and linear between the ``T`` at which some worker
    reaches a bound, so the segment containing ``B`` is found (by bisection: a scan
    costs O(n^2) a round, bench/RESULTS.md 9b) and solved exactly.
    The shares are then rounded by largest remainder, keeping the sum exact.

    When ``B`` is outside the sum of the lower bounds and the sum of the upper
    ones, every worker gets the violated bound and the sum differs from ``B``
    (see ``_infeasible``). Raises ValueError for ``B < 0``, ``b_min < 1``,
    ``b_max < b_min`` or a cap below 1. No models gives ``{}``.
    """
    _check_bounds(global_batch, b_min, b_max)
    ids = sorted(models)
    if not ids:
        return {}
    lo, hi = _worker_bounds(ids, b_min, b_max, caps)
    pinned = _infeasible(ids, global_batch, lo, hi)
    if pinned is not None:
        return pinned

    a = np.array([models[w].fixed_s for w in ids], dtype=float)
    c = np.array([models[w].per_sample_s for w in ids], dtype=float)
    t_low = a + c * lo
    t_high = a + c * hi

    def total(t: float) -> float:
        return float(np.clip((t - a) / c, lo, hi).sum())

    breaks = np.unique(np.concatenate([t_low, t_high]))
    k = bisect.bisect_left(range(len(breaks)), True, key=lambda i: total(float(breaks[i])) >= global_batch)
    mid = 0.5 * (breaks[k - 1] + breaks[k])
    at_min = t_low >= mid
    at_max = t_high <= mid
    free = ~(at_min | at_max)
    rest = global_batch - int(lo[at_min].sum()) - int(hi[at_max].sum())
    t = (rest + float((a[free] / c[free]).sum())) / float((1.0 / c[free]).sum())
    shares = np.clip((t - a) / c, lo, hi)
    return _largest_remainder(ids, shares, global_batch)


def allocate_compute(
    models: Mapping[str, StepModel],
    global_batch: int,
    b_min: int,
    b_max: int,
    caps: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Batch sizes proportional to each worker's compute speed ``1/c_i`` (the same compute time per step),
    summing to ``global_batch``: the split for protocols where no step waits on another (asgd, softsync).

    ``allocate`` equalizes whole steps, so a worker behind a slow link, whose pull and push land in its fixed
    cost ``a_i``, gets a smaller batch the slower its link, which makes communication an ever larger share of its
    step and its throughput ``b_i / (a_i + c_i*b_i)`` ever smaller (bench/RESULTS.md section 8). Where nothing
    waits for that worker's step, equal steps buy nothing: moving samples from a worker with a small ``a`` to one
    with a large ``a`` costs the first almost no throughput and raises the second's. Taking the batch as if
    ``a_i = 0`` keeps every worker's compute share whatever its link, and bounds staleness: workers on equal links
    keep equal steps (so equal staleness), and a slow-link worker's step, hence the staleness of its gradients, is
    longer only by its own communication, ``(a_i + T_c) / (a_j + T_c)``; the split of most total samples/s (step
    times growing as ``sqrt(a_i)``) would make a slow link's step longer still against fast links with small
    ``a_j``. Bounds and rounding as in ``allocate``. The scheduler passes models whose ``c_i`` is the compute
    time the worker reports per sample (``SpeedModel.compute_fit``): the step fit's ``c_i`` holds a slow link's
    transfers until its batch has varied enough to identify ``a_i``.
    """
    compute_only = {w: StepModel(0.0, m.per_sample_s) for w, m in models.items()}
    return allocate(compute_only, global_batch, b_min, b_max, caps)


Allocation = Callable[[Mapping[str, StepModel], int, int, int, Mapping[str, int] | None], dict[str, int]]
"""The signature the scheduler's dynamic policy calls: (models, global_batch, b_min, b_max, caps) to batches."""


def allocation_for(spec: ProtocolSpec) -> Allocation:
    """The dynamic policy's split for a protocol: a sized round's (``allocate_round``), equal steps where a slower
    step costs the others (``ProtocolSpec.equal_steps``), else each worker's compute share (``allocate_compute``)."""
    if spec.sized_rounds:
        return allocate_round
    return allocate if spec.equal_steps else allocate_compute


def fixed_allocation(
    workers: Sequence[str],
    global_batch: int,
    b_min: int,
    b_max: int,
    caps: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Equal shares ``B // n``, the remainder one each to the first workers by id.

    Used by the static policies, and by ``dynamic`` before any worker has a speed
    model. A worker held below the equal share by its bounds keeps its bound and
    the others share the rest equally (water-filling, in integers: the level
    ``L`` is the largest with ``sum clip(L, lo, hi) <= B``, and the remainder goes
    one each to the first workers by id that can still grow). Out-of-range
    ``B`` is handled as in ``allocate``.
    """
    _check_bounds(global_batch, b_min, b_max)
    ids = sorted(set(workers))
    if not ids:
        return {}
    lo, hi = _worker_bounds(ids, b_min, b_max, caps)
    pinned = _infeasible(ids, global_batch, lo, hi)
    if pinned is not None:
        return pinned
    low, high = int(lo.min()), int(hi.max())
    while low < high:  # the largest level whose clipped sum fits in B
        mid = (low + high + 1) // 2
        if int(np.clip(mid, lo, hi).sum()) <= global_batch:
            low = mid
        else:
            high = mid - 1
    batches = np.clip(low, lo, hi)
    growable = [i for i in range(len(ids)) if lo[i] <= low < hi[i]]
    for i in growable[: global_batch - int(batches.sum())]:
        batches[i] += 1
    return {worker: int(b) for worker, b in zip(ids, batches, strict=True)}


def needs_reassign(current: Mapping[str, int], proposed: Mapping[str, int], threshold: float) -> bool:
    """Whether ``proposed`` differs enough from ``current`` to be sent to the workers.

    Hysteresis: every change of batch size costs something (a new shape to
    compile or warm up, a learning-rate rescale, a less comparable speed sample),
    and the speed models are noisy, so small proposed moves are ignored. A change
    of the worker set always counts: a new worker needs a batch, and a departed
    one's share must go to the others. Otherwise True when some worker's batch
    moves by more than ``threshold`` relative to its current one.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if current.keys() != proposed.keys():
        return True
    return any(
        abs(proposed[w] - old) > threshold * old if old > 0 else proposed[w] != old for w, old in current.items()
    )


LEAVE_OUT_GAIN = 0.02
"""How much faster (samples/s) a round must be predicted to run without its slowest worker before that worker
is left out: the speed models are noisy, and a worker left out is not measured again until it is back."""


def round_samples_per_s(models: Mapping[str, StepModel], batches: Mapping[str, int]) -> float:
    """A synchronous round's predicted throughput: its samples over its slowest worker's predicted step."""
    taking = {w: b for w, b in batches.items() if b > 0}
    if not taking:
        return 0.0
    return sum(taking.values()) / max(models[w].step_seconds(b) for w, b in taking.items())


def allocate_round(
    models: Mapping[str, StepModel],
    global_batch: int,
    b_min: int,
    b_max: int,
    caps: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """``allocate`` for a round of B samples at one model version (ssgd's LB-BSP, rennala), where the round ends
    with its slowest worker: batch 0 for the slowest workers when the round is faster without them.

    ``allocate`` gives every worker at least its lower bound, so a worker whose fixed
    cost ``a_i`` alone (or ``a_i + c_i*lo_i``) exceeds the others' equal step time
    ``T`` makes every round wait for it. Workers are ranked by their predicted step at
    their lowest batch, slowest first; leaving out the k slowest (the others re-solved
    with the whole of B) is tried for k = 0, 1, ... while the slowest worker kept is
    held at its lowest batch (once it is not, the round is the others' equal step time,
    which only grows as more leave), and the k with the most samples per second wins
    if it beats keeping everyone by ``LEAVE_OUT_GAIN``. All k slowest go together:
    with several equally slow workers, leaving out one alone gains nothing. One worker
    is always kept. Left-out workers are in the result with batch 0.
    """
    ids = sorted(models)
    if not ids:
        return {}
    lo, _ = _worker_bounds(ids, b_min, b_max, caps)
    lowest = dict(zip(ids, (int(b) for b in lo), strict=True))
    ranked = sorted(ids, key=lambda w: (-models[w].step_seconds(lowest[w]), w))
    everyone = allocate(models, global_batch, b_min, b_max, caps)
    best, best_rate = everyone, round_samples_per_s(models, everyone)
    worth_it = (1 + LEAVE_OUT_GAIN) * best_rate
    batches = everyone
    for k in range(1, len(ids)):
        if batches[ranked[k - 1]] > lowest[ranked[k - 1]]:
            break
        batches = allocate({w: models[w] for w in ranked[k:]}, global_batch, b_min, b_max, caps)
        rate = round_samples_per_s(models, batches)
        if rate > max(best_rate, worth_it):
            best, best_rate = batches, rate
    return {w: best.get(w, 0) for w in ids}
