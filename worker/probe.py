"""The standalone speed a worker reports before it is given a batch.

The scheduler's first split comes from these numbers (the speed model's prior),
so the virtual-time simulator (bench/simulate.py) probes with the same rule: it
must not drift from the worker it stands in for.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

PROBE_BATCH = 64


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
