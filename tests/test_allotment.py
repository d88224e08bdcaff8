"""The floor of a worker's batch (common/allotment.py): the end of the job's budget never hands a worker a batch
below MIN_BATCH (a training forward of one sample cannot normalise a BatchNorm layer), and a gradient protocol still
trains exactly its allotment."""

from __future__ import annotations

import itertools

import pytest

from dynabatch.common.allotment import MIN_BATCH, allotted_batch, batch_problem, floored, least_left
from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import protocol_spec
from dynabatch.scheduler.allocator import Allocator


def _pushes(batch: int, left: int, steps: int) -> list[int]:
    """The per-step batches a worker assigned `batch` takes, push after push, until `left` samples are trained."""
    out = []
    while (b := allotted_batch(batch, left, steps)) > 0:
        out.append(b)
        left -= b * steps
    return out


@pytest.mark.parametrize("steps", [1, 4, 8])
def test_no_push_of_an_allotment_is_below_the_floor_and_it_passes_the_allotment_by_fewer_than_its_steps(
    steps: int,
) -> None:
    for batch, left in itertools.product(range(2 * MIN_BATCH - 1, 40), range(least_left(steps), 400)):
        pushes = _pushes(batch, left, steps)
        assert all(MIN_BATCH <= b <= batch for b in pushes), (batch, left, pushes)
        assert 0 <= sum(pushes) * steps - left < steps, (batch, left, pushes)
        if left >= steps * batch:  # an allotment of a push or more ends on no push under half of one
            assert 2 * min(pushes) >= batch, (batch, left, pushes)


def test_the_push_before_the_last_shares_a_remainder_under_half_a_push_so_that_the_last_is_not_a_few_samples() -> None:
    assert _pushes(48, 49, 1) == [25, 24], "49 left at 48 a push: not 48 then 1, nor 47 then 2"
    assert _pushes(48, 96 + 1, 1) == [48, 25, 24]
    assert _pushes(48, 48 + 24, 1) == [48, 24], "half a push left is a push of its own"
    assert _pushes(71, 8 * 71 + 56, 8) == [39, 39], "the main job's last local round: not 8 steps of 7 samples"
    assert _pushes(32, 5, 8) == [2], "an allotment of a few samples in all still trains them"
    assert _pushes(4, 5, 1) == [3, 2] and _pushes(3, 4, 1) == [2, 2], "small batches keep the floor"
    assert allotted_batch(1, 1) == 1, "a worker whose own cap is 1 sample still trains"
    assert allotted_batch(48, None) == 48 and allotted_batch(48, 0) == 0


def test_a_share_that_would_leave_a_worker_under_one_push_is_folded_into_the_largest() -> None:
    assert floored({"a": 47, "b": 1}, {"a": 0, "b": 0}) == {"a": 46, "b": 2}, "the largest share gives what it lacks"
    assert floored({"a": 1, "b": 1}, {"a": 0, "b": 0}) == {"a": 0, "b": 2}, "too little to give: taken whole"
    assert floored({"a": 30, "b": 3}, {"a": 0, "b": 0}, steps=8) == {"a": 24, "b": 9}
    assert floored({"a": 5, "b": 0}, {"a": 0, "b": 40}) == {"a": 5, "b": 0}, "only shares move"
    assert floored({"a": 1}, {"a": 0, "b": 40}) == {"a": 0, "b": 1}, "one with more to train takes it"
    assert floored({"a": 2, "c": 1}, {"b": 40}) == {"a": 2, "b": 1, "c": 0}, "the most to train, not the largest share"
    assert floored({"a": 1}, {"a": 0, "b": 0}) == {"a": 1, "b": 0}, "every other is done: it stays"


def test_a_worker_refuses_a_batch_below_the_floor_unless_its_own_memory_is_that_small() -> None:
    assert batch_problem(1, 0) is not None and batch_problem(1, 64) is not None
    assert batch_problem(1, 1) is None, "a --max-batch 1 worker trains on single samples"
    assert batch_problem(65, 64) is not None and batch_problem(-1, 0) is not None
    assert batch_problem(0, 0) is None and batch_problem(MIN_BATCH, 0) is None


@pytest.mark.parametrize(("protocol", "steps"), [("asgd", 1), ("ssgd", 1), ("local", 8)])
def test_the_scheduler_hands_out_every_budget_with_no_batch_below_the_floor(protocol: str, steps: int) -> None:
    """Three workers at 32 each trained to budgets of 20 to 900 samples, each answered in turn: every batch
    handed is at least MIN_BATCH, a gradient protocol trains exactly its budget, a local round passes it by less
    than its H steps per worker. The rule before the floor handed a batch of 1 at 11 of these 381 budgets."""
    job = JobConfig(dataset="synthetic", global_batch=96, batch_policy="fixed", protocol=protocol, local_steps=steps)
    for budget in range(20, 900, 7):
        allocator = Allocator(job, protocol_spec(protocol))
        for wid in ("w0", "w1", "w2"):
            allocator.measure(wid, 1000.0, instance="")
        allocator.reallocate(0.0, 0.0, "joined", "w2", {"w0": 0, "w1": 0, "w2": 0}, force=True)
        samples, counts, handed = {"w0": 0, "w1": 0, "w2": 0}, {"w0": 0, "w1": 0, "w2": 0}, []
        while True:
            for worker in samples:
                allocator.allot(worker, samples, counts, budget)
                batch = allocator.batch_of(worker)
                handed.append(batch)
                samples[worker] += batch * steps
                counts[worker] += steps if batch else 0
            if not any(handed[-3:]):
                break
        past = sum(samples.values()) - budget
        assert min(b for b in handed if b) >= MIN_BATCH and 0 <= past < max(1, 3 * (steps - 1) + 1), (budget, past)
