"""The standalone speed a worker reports before it is given a batch, and its fixed cost per step.

The scheduler's first split comes from these numbers (the speed model's prior), so the worker
(worker/trainer.py) and the virtual-time simulator (bench/simulate.py) both run the probe's steps
(`probe_steps`) and read them (`probed`) here: the simulated worker cannot drift from the real one.
The probe times two batch sizes, so that the scheduler knows a device's fixed cost per step (kernel
launches, a slow device's start-up per step) before its first step: under a fixed split the batch never
varies, and the speed model could not tell it from the per-sample cost. The scheduler reads the fixed
cost against the probe's own step (`probe_batch`), as the fraction of a step it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from dynabatch.common.allotment import MIN_BATCH

PROBE_BATCH = 64
SMALL_FRACTION = 4  # the probe's second batch is the first over this
MAX_FIXED_FRACTION = 0.9
"""Upper bound on a fixed cost as a fraction of the step it is read from: the per-sample cost stays at least a tenth
of the step's per sample, so a noisy fixed cost never makes a worker look as if more samples cost nothing."""


def probe_batch(job_max_batch: int, own_max_batch: int = 0) -> int:
    """The probe's batch: 64 samples, or less where the job's or this worker's --max-batch is smaller."""
    return min(PROBE_BATCH, job_max_batch, own_max_batch or job_max_batch)


def standalone_speed(batch: int, timed_seconds: Sequence[float]) -> float:
    """Samples/s of forward+backward alone: `batch` over the median of the timed steps.

    The median, because processes starting beside a worker (imports, data loading)
    make single steps slow at random. The first, untimed step (caches, lazy
    initialisation) is not among `timed_seconds`.
    """
    return batch / statistics.median(timed_seconds)


def small_probe_batch(batch: int) -> int:
    """The probe's second, smaller batch beside `batch` (0: `batch` is too small to have one): never below the
    smallest batch a worker steps with (common/allotment.py), which every model can train on."""
    small = batch // SMALL_FRACTION
    return small if MIN_BATCH <= small < batch else 0


def fixed_cost(small: int, small_s: float, large: int, large_s: float) -> float:
    """A step's fixed seconds from the line through (small, small_s) and (large, large_s): its intercept, at least 0
    and at most either step's time. Medians of a loaded machine may cross, a small batch's steps stalled slower
    than the large one's, and a fixed part longer than the probe's own step is one the scheduler refuses
    (scheduler/report_bounds.py): a worker that reported it was never admitted."""
    per_sample = (large_s - small_s) / (large - small)
    return min(max(0.0, small_s - per_sample * small), small_s, large_s)


def probe_steps(batch: int, timed: int) -> list[int]:
    """The batch of each of the probe's timed steps, in order: `timed` of `batch` and, where it has one, `timed` of
    its small batch, the two taken in turn. One untimed step of `batch` goes before them (caches, lazy
    initialisation).

    In turn, so that load which comes and goes while the probe runs (the job's other processes starting) slows both
    batches alike: that overstates the fixed cost only by the factor it understates the speed, which the scheduler
    takes out (scheduler/speed_model.py, `probe_fixed_s`); load on one batch's steps alone would not be."""
    small = small_probe_batch(batch)
    return [b for _ in range(timed) for b in ((batch, small) if small else (batch,))]


def probed(steps: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """The standalone speed and the fixed seconds per step from the seconds of each of `probe_steps`' steps: the
    large batch's median speed, and the line through both batches' medians (0 where there was no small batch)."""
    batch, timed = steps[0], list(zip(steps, seconds, strict=True))
    large_s = [s for b, s in timed if b == batch]
    small_s = [s for b, s in timed if b != batch]
    speed = standalone_speed(batch, large_s)
    if not small_s:
        return speed, 0.0
    return speed, fixed_cost(min(steps), statistics.median(small_s), batch, statistics.median(large_s))


def fixed_through(batch: float, seconds: float, probe_batch: int, standalone_sps: float, fixed_s: float) -> float:
    """The fixed seconds of a step of `batch` samples that computed for `seconds`, by the start-up probe: the
    probe's curve (`fixed_s`, the rest of its step at `probe_batch` per sample, at `standalone_sps`) scaled to pass
    through (`batch`, `seconds`), its fixed fraction at most MAX_FIXED_FRACTION.

    The probe runs while the job's other processes start, and contention there slows its two batches alike: its
    fixed seconds are then overstated by the factor its speed is understated by, and the steps, which run at the
    job's own pace, never show it (a batch that does not vary cannot tell a fixed cost from a per-sample one). The
    fraction of the probe's step that is fixed is what that slowdown leaves true. A probe whose small batch alone
    was slowed keeps its error."""
    share = min(fixed_s * standalone_sps / probe_batch, MAX_FIXED_FRACTION)
    return seconds * share * probe_batch / (share * probe_batch + (1.0 - share) * batch)
