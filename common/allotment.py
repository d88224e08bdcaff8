"""The job's sample budget, as a worker's batch sees it: a push takes no more than the worker has left.

The scheduler allots each worker a number of samples (in the worker's own
count, `WorkerHeartbeat.samples`) that it may have trained in all
(`WorkerAssignment.allotted`), and allots no more than the job's epochs of the
training set. A worker that reaches its allotment takes no step until it is
given more, so a job ends within what it was asked for whatever the lag
between a worker's steps and the scheduler's answers; the last push of a
worker is sized to what it has left. The scheduler's batch for a worker and
the batch the worker steps with both come from `allotted_batch`.
"""

from __future__ import annotations

import math


def allotted_batch(batch: int, left: int | None, steps: int = 1) -> int:
    """The batch of a push of `steps` local steps (1 for a gradient push) by a worker assigned `batch` with `left`
    samples of its allotment (None: no allotment, the job has no epoch budget).

    The last push takes ceil(left / steps) per step, so it may pass the allotment by fewer than `steps` samples;
    0 once nothing is left.
    """
    if left is None:
        return batch
    return min(batch, math.ceil(max(0, left) / max(1, steps)))
