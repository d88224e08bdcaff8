"""Turning per-worker speed models into per-worker batch sizes.

All functions are pure and deterministic: ties are broken by worker id, so two
schedulers (or a restarted one) given the same inputs hand out the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dynabatch.scheduler.speed_model import StepModel


def _check_bounds(global_batch: int, b_min: int, b_max: int) -> None:
    if global_batch < 0:
        raise ValueError(f"global_batch must be >= 0, got {global_batch}")
    if b_min < 1:
        raise ValueError(f"b_min must be >= 1, got {b_min}")
    if b_max < b_min:
        raise ValueError(f"b_max ({b_max}) must be >= b_min ({b_min})")


def _infeasible(
    ids: Sequence[str], global_batch: int, b_min: int, b_max: int
) -> dict[str, int] | None:
    """Everyone at the violated bound when ``global_batch`` is outside ``[n*b_min, n*b_max]``.

    This is not an error: the configuration is validated up front, but workers
    joining or leaving at runtime can make the bounds infeasible, and the job must
    go on. The per-worker bounds win over the global batch, whose sum then differs.
    """
    n = len(ids)
    if global_batch <= n * b_min:
        return dict.fromkeys(ids, b_min)
    if global_batch >= n * b_max:
        return dict.fromkeys(ids, b_max)
    return None


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
    return {worker: int(x) for worker, x in zip(ids, rounded)}


def allocate(
    models: Mapping[str, StepModel], global_batch: int, b_min: int, b_max: int
) -> dict[str, int]:
    """Batch sizes giving every worker the same predicted step time, summing to ``global_batch``.

    Unconstrained, ``a_i + c_i*b_i = T`` for all i and ``sum b_i = B`` give
    ``T = (B + sum a_i/c_i) / sum(1/c_i)`` and ``b_i = (T - a_i)/c_i``. With bounds,
    workers whose share falls outside ``[b_min, b_max]`` are pinned there and the
    others re-solved with the rest of the batch. Pinning and re-solving in rounds
    can pin a worker too early when some hit the lower bound and others the upper
    one in the same round, so the fixed point of that process is computed
    directly instead: ``sum clip((T - a_i)/c_i, b_min, b_max)`` is continuous and
    nondecreasing in ``T`` and linear between the ``T`` at which some worker
    reaches a bound, so the segment containing ``B`` is found and solved exactly.
    The shares are then rounded by largest remainder, keeping the sum exact.

    When ``B`` is outside ``[n*b_min, n*b_max]`` every worker gets the violated
    bound and the sum differs from ``B`` (see ``_infeasible``). Raises ValueError
    for ``B < 0``, ``b_min < 1`` or ``b_max < b_min``. No models gives ``{}``.
    """
    _check_bounds(global_batch, b_min, b_max)
    ids = sorted(models)
    if not ids:
        return {}
    pinned = _infeasible(ids, global_batch, b_min, b_max)
    if pinned is not None:
        return pinned

    a = np.array([models[w].fixed_s for w in ids], dtype=float)
    c = np.array([models[w].per_sample_s for w in ids], dtype=float)
    t_low = a + c * b_min
    t_high = a + c * b_max

    def total(t: float) -> float:
        return float(np.clip((t - a) / c, b_min, b_max).sum())

    breaks = np.unique(np.concatenate([t_low, t_high]))
    k = next(i for i, t in enumerate(breaks) if total(t) >= global_batch)
    mid = 0.5 * (breaks[k - 1] + breaks[k])
    at_min = t_low >= mid
    at_max = t_high <= mid
    free = ~(at_min | at_max)
    rest = global_batch - b_min * int(at_min.sum()) - b_max * int(at_max.sum())
    t = (rest + float((a[free] / c[free]).sum())) / float((1.0 / c[free]).sum())
    shares = np.clip((t - a) / c, b_min, b_max)
    return _largest_remainder(ids, shares, global_batch)


def fixed_allocation(
    workers: Sequence[str], global_batch: int, b_min: int, b_max: int
) -> dict[str, int]:
    """Equal shares ``B // n``, the remainder one each to the first workers by id.

    Used by the static policies, and by ``dynamic`` before any worker has a speed
    model. Out-of-range ``B`` is handled as in ``allocate``.
    """
    _check_bounds(global_batch, b_min, b_max)
    ids = sorted(set(workers))
    if not ids:
        return {}
    pinned = _infeasible(ids, global_batch, b_min, b_max)
    if pinned is not None:
        return pinned
    base, extra = divmod(global_batch, len(ids))
    return {worker: base + (i < extra) for i, worker in enumerate(ids)}


def needs_reassign(
    current: Mapping[str, int], proposed: Mapping[str, int], threshold: float
) -> bool:
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
        abs(proposed[w] - old) > threshold * old if old > 0 else proposed[w] != old
        for w, old in current.items()
    )
