"""ps/push_bounds.py: a PUSH's samples and base versions within what its sender can have been told."""

from __future__ import annotations

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.push_bounds import (
    OVERLAP_SLACK,
    AssignedBatches,
    check_push_numbers,
    check_push_samples,
    max_push_samples,
)


@pytest.mark.parametrize("protocol, steps", [("asgd", 1), ("ssgd", 1), ("local", 8), ("msd", 8 * OVERLAP_SLACK)])
def test_the_most_samples_is_max_batch_times_the_steps_one_push_can_cover(protocol: str, steps: int) -> None:
    assert max_push_samples(JobConfig(protocol=protocol, max_batch=64, local_steps=8)) == 64 * steps


def test_numbers_within_bounds_pass() -> None:
    check_push_numbers(64, {0: 3, 1: 5}, {0: 3, 1: 7}, 64)


@pytest.mark.parametrize(
    "samples, bases, field",
    [
        (0, {0: 3}, "PUSH.samples"),
        (-8, {0: 3}, "PUSH.samples"),
        (65, {0: 3}, "PUSH.samples"),
        (2**62, {0: 3}, "PUSH.samples"),
        (8, {0: 4}, "PUSH.chunks[0].version"),
        (8, {0: 3, 1: 2**62}, "PUSH.chunks[1].version"),
    ],
)
def test_numbers_out_of_bounds_are_refused_naming_the_field(samples: int, bases: dict[int, int], field: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        check_push_numbers(samples, bases, {0: 3, 1: 7}, 64)
    assert refused.value.code == "bad_field" and field in refused.value.text


def test_a_push_is_bounded_by_its_senders_batch_of_the_last_two_bounds_times_the_steps() -> None:
    assigned = AssignedBatches(steps=4, job_max=1024)
    assert assigned.told is None and assigned.limit("w0") == 0, "nothing applied yet: nothing to report or push"
    assert assigned.update({"w0": 32, "w1": 8}), "a bound grew: the shard reports it at once"
    assert assigned.limit("w0") == 128 and assigned.limit("w1") == 32 and assigned.limit("w9") == 0
    assert not assigned.update({"w0": 16}), "a smaller bound need not be reported before the next heartbeat"
    assert assigned.limit("w0") == 128, "a worker may still step with the batch it was told before"
    assert assigned.limit("w1") == 32
    assert not assigned.update({"w0": 16}), "every answer repeats the bounds"
    assert assigned.limit("w0") == 128, "a repeated answer does not forget what a push in flight may carry"
    assigned.update({"w0": 8})
    assert assigned.limit("w0") == 64 and assigned.limit("w1") == 0
    assert assigned.update({"w0": 1000}) and assigned.told == {"w0": 1000}
    assert assigned.limit("w0") == 1024, "never beyond the job's own bound"


def test_a_push_beyond_its_senders_assignment_is_refused_naming_the_field() -> None:
    assigned = AssignedBatches(steps=1, job_max=1024)
    assigned.update({"w0": 32})
    check_push_samples(32, "w0", assigned)
    with pytest.raises(ProtocolError) as refused:
        check_push_samples(33, "w0", assigned)
    assert refused.value.code == "bad_field" and "PUSH.samples 33" in refused.value.text
