"""The `efficient` batch policy: each worker sized for its own efficiency, not for equal steps.

A worker's step is ``t_i(b) = a_i + c_i*b`` (speed_model.py), so its throughput
``b / (a_i + c_i*b)`` rises with its batch towards ``1/c_i``, and is the fraction
``c_i*b / (a_i + c_i*b)`` of that limit: one minus the fixed cost's share of the
step. A fast accelerator has a large ``a_i/c_i`` (launching its kernels costs what
hundreds of its samples do) and needs a large batch to be efficient; a slow device
is efficient at a small one. Equal shares (`fixed`) leave the first far below its
limit; equal steps (`dynamic`) size every worker by its step time, not by where its
own curve flattens.

Its knee is the smallest batch at which the fixed cost is at most ``FIXED_SHARE``
of the step (90% of its limit): ``b >= a_i (1 - f) / (f c_i)``.

The transfer is part of ``a_i``: a worker's pulls and pushes take the same time
whatever its batch, so they are a fixed cost of its step exactly as kernel launches
are, and the scheduler's model of a worker (``SpeedModel.overhead_fit``) counts
everything its heartbeats report besides computing in ``a_i`` from the first step.
A worker behind a slow link therefore has a larger knee and gets a larger batch,
which amortises its transfers over more samples; no separate link rule is needed.

The global batch stays B (bounds permitting), for two reasons: B is the user's
statistical choice, the one the learning rate was tuned for, and the shards weight
each gradient by ``b_i / (B/n)`` (DBS-SGD's weight, common/protocols.py) against that
same B, so a split that sums to B keeps both meaning what they meant and nothing on
the shards changes. Within B:

- when the knees (each under its worker's cap) sum to at most B, every worker gets at
  least its knee, and beyond it the split of equal compute time ``c_i*b_i`` (the one the
  dynamic policy gives asynchronous protocols, batch_allocation.allocate_compute): past
  its knee a worker's throughput is close to ``1/c_i`` whatever its batch, so the
  samples go where they take the least time; a worker whose knee is more than that
  share keeps its knee;
- when they sum to more, every worker gets the same fraction of its knee, which is the
  same fixed-cost share of every worker's step: B cannot buy everyone its knee, and no
  worker is then left far below its own while another sits at its.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from dynabatch.scheduler.batch_allocation import _check_bounds, _infeasible, _largest_remainder, _worker_bounds
from dynabatch.scheduler.speed_model import StepModel

FIXED_SHARE = 0.1
"""The largest share of a step its fixed cost may take at a worker's knee: there it runs at 90% of the throughput
an unbounded batch would give it, and doubling its batch would gain it at most 5% more."""

BISECTIONS = 50  # the level to 2**-50 of its bracket: its shares off by far less than a sample


def knee(model: StepModel, fixed_share: float = FIXED_SHARE) -> float:
    """The smallest batch at which `model`'s fixed cost is at most `fixed_share` of its step:
    ``a <= f (a + c b)``, i.e. ``b >= a (1 - f) / (f c)``; 0 for a step with no fixed cost."""
    if not 0.0 < fixed_share < 1.0:
        raise ValueError(f"fixed_share must be in (0, 1), got {fixed_share!r}")
    return model.fixed_s * (1.0 - fixed_share) / (fixed_share * model.per_sample_s)


def _fill(shares: Callable[[float], np.ndarray], total: int, high: float) -> np.ndarray:
    """``shares(x)`` at the smallest ``x`` in ``[0, high]`` where they sum to at least `total`.

    ``shares`` is continuous and nondecreasing in ``x``, sums to at most `total` at 0 and at least it at `high`.
    """
    low = 0.0
    for _ in range(BISECTIONS):
        mid = 0.5 * (low + high)
        if float(shares(mid).sum()) >= total:
            high = mid
        else:
            low = mid
    return shares(high)


def efficient_batches(
    models: Mapping[str, StepModel],
    global_batch: int,
    b_min: int,
    b_max: int,
    caps: Mapping[str, int] | None = None,
    fixed_share: float = FIXED_SHARE,
) -> dict[str, int]:
    """Each worker's batch from its knee (`knee`), under its bounds, the batches summing to `global_batch`.

    The module's docstring says why the sum is B and how the split goes on either side of the knees' sum.
    Bounds are batch_allocation.py's (the job's ``[b_min, b_max]``, a worker's cap below them), and so is the
    rounding (largest remainder, the sum kept exact) and a B the bounds cannot hold (everyone at the violated
    bound). Raises ValueError as `allocate` does, and for a `fixed_share` outside (0, 1). No models gives ``{}``.
    """
    _check_bounds(global_batch, b_min, b_max)
    ids = sorted(models)
    if not ids:
        return {}
    lo, hi = _worker_bounds(ids, b_min, b_max, caps)
    knees = np.clip([knee(models[w], fixed_share) for w in ids], lo, hi)
    pinned = _infeasible(ids, global_batch, lo, hi)
    if pinned is not None:
        return pinned
    if float(knees.sum()) <= global_batch:
        c = np.array([models[w].per_sample_s for w in ids], dtype=float)
        shares = _fill(lambda t: np.clip(t / c, knees, hi), global_batch, float((hi * c).max()))
    else:
        shares = _fill(lambda x: np.maximum(x * knees, lo), global_batch, 1.0)
    return _largest_remainder(ids, shares, global_batch)
