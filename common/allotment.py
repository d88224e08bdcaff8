"""The job's sample budget, as a worker's batch sees it: a push takes no more than the worker has left, and no
batch a worker steps with is below `MIN_BATCH`.

The scheduler allots each worker a number of samples (in the worker's own
count, `WorkerHeartbeat.samples`) that it may have trained in all
(`WorkerAssignment.allotted`), and allots no more than the job's epochs of the
training set. A worker that reaches its allotment takes no step until it is
given more, so a job ends within what it was asked for whatever the lag
between a worker's steps and the scheduler's answers; the last push of a
worker is sized to what it has left. The scheduler's batch for a worker and
the batch the worker steps with both come from `allotted_batch`.

The floor: a training forward of one sample cannot normalise a batch (BatchNorm
refuses one value per channel), so no batch is below `MIN_BATCH`. The job's batch
bounds may not be below it (`--min-batch`, `--max-batch`); only a worker's own
`--max-batch` may, a cap being physical. The remainder of an allotment is never left
under half a push: the push before shares it (`allotted_batch`), and the scheduler
folds a share of the budget that would leave a worker less than one such push into
another worker's (`floored`). A worker refuses a batch below it (`batch_problem`).
"""

from __future__ import annotations

import math

MIN_BATCH = 2  # the smallest batch every model trains on (BatchNorm needs two values per channel)


def least_left(steps: int = 1) -> int:
    """The fewest samples an allotment may leave a worker besides 0: one push of `steps` local steps of at least
    MIN_BATCH each, passing the allotment by fewer than `steps` samples (ceil(left / steps) >= MIN_BATCH)."""
    return max(1, steps) * (MIN_BATCH - 1) + 1


def allotted_batch(batch: int, left: int | None, steps: int = 1) -> int:
    """The batch of a push of `steps` local steps (1 for a gradient push) by a worker assigned `batch` with `left`
    samples of its allotment (None: no allotment, the job has no epoch budget).

    The last push takes ceil(left / steps) per step, so it may pass the allotment by fewer than `steps` samples;
    0 once nothing is left. A push that would leave less than half a push splits what is left between itself and
    the last, about evenly: a last round of a few samples a step (a share's remainder) is a noisy gradient and, for
    H local steps, BatchNorm statistics of tiny batches in the model that the job ends on (bench/RESULTS.md 33:
    the main job's last round). Where even that would leave less
    than `least_left`, the push takes less, so that the last is not below MIN_BATCH (possible wherever `batch` is
    at least 2 x MIN_BATCH - 1); what is left is never below it when the scheduler allotted it (`floored`), and
    were it so, the push takes MIN_BATCH per step.
    """
    if left is None:
        return batch
    steps, left = max(1, steps), max(0, left)
    if left == 0:
        return 0
    if left <= steps * batch:
        return max(min(MIN_BATCH, batch), math.ceil(left / steps))
    least = least_left(steps)
    if left - steps * batch >= max(least, math.ceil(steps * batch / 2)):
        return batch
    half = math.ceil(left / (2 * steps))
    if left - steps * half >= least:
        return half
    shorter = (left - least) // steps
    return shorter if shorter >= MIN_BATCH else batch


def floored(shares: dict[str, int], left: dict[str, int], steps: int = 1) -> dict[str, int]:
    """`shares` of the budget's last samples (by worker), each added to what its worker had `left` (by worker, those
    given no share included), with every share that would leave its worker less than `least_left(steps)` but more
    than 0 folded: the worker with the largest share gives it what it lacks of that push where its own share can
    spare it, else the worker with the most to train takes the share into its own. Only shares move, so no
    allotment shrinks below what its worker may be stepping with; the sum is unchanged. A share no other worker
    can take (every other is done) stays: its worker passes it by less than a push of MIN_BATCH."""
    out = {w: shares.get(w, 0) for w in shares.keys() | left.keys()}
    least = least_left(steps)
    for w in sorted(out):
        short = left.get(w, 0) + out[w]
        if not (0 < short < least and out[w] > 0):
            continue
        others = [o for o in sorted(out) if o != w and left.get(o, 0) + out[o] > 0]
        if not others:
            continue
        donor, lacking = max(others, key=lambda o: (out[o], left.get(o, 0) + out[o])), least - short
        if out[donor] >= lacking and left.get(donor, 0) + out[donor] - lacking >= least:
            out[donor] -= lacking
            out[w] += lacking
        else:
            taker = max(others, key=lambda o: (left.get(o, 0) + out[o], out[o]))
            out[taker] += out[w]
            out[w] = 0
    return out


def batch_problem(batch: int, own_max: int) -> str | None:
    """Why a worker whose own largest batch is `own_max` (0: none) cannot step with `batch` from its assignment
    (None: it can). Below MIN_BATCH only where its own cap is (a cap is physical and wins over the floor)."""
    least = min(MIN_BATCH, own_max or MIN_BATCH)
    if batch < 0 or 0 < batch < least:
        return f"batch {batch} is below the smallest a worker steps with ({least})"
    if own_max and batch > own_max:
        return f"batch {batch} is above this worker's --max-batch {own_max}"
    return None
