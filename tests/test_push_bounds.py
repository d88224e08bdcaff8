"""ps/push_bounds.py: a PUSH's samples and base versions within what its sender can have been told."""

from __future__ import annotations

import pytest

from dynabatch.common.config import JobConfig
from dynabatch.common.wire import ProtocolError
from dynabatch.ps.push_bounds import OVERLAP_SLACK, check_push_numbers, max_push_samples


@pytest.mark.parametrize("protocol, steps", [("asgd", 1), ("ssgd", 1), ("local", 8),
                                             ("msd", 8 * OVERLAP_SLACK)])
def test_the_most_samples_is_max_batch_times_the_steps_one_push_can_cover(protocol, steps):
    assert max_push_samples(JobConfig(protocol=protocol, max_batch=64, local_steps=8)) == 64 * steps


def test_numbers_within_bounds_pass():
    check_push_numbers(64, {0: 3, 1: 5}, {0: 3, 1: 7}, 64)


@pytest.mark.parametrize("samples, bases, field", [
    (65, {0: 3}, "PUSH.samples"),
    (2 ** 62, {0: 3}, "PUSH.samples"),
    (8, {0: 4}, "PUSH.chunks[0].version"),
    (8, {0: 3, 1: 2 ** 62}, "PUSH.chunks[1].version"),
])
def test_numbers_out_of_bounds_are_refused_naming_the_field(samples, bases, field):
    with pytest.raises(ProtocolError) as refused:
        check_push_numbers(samples, bases, {0: 3, 1: 7}, 64)
    assert refused.value.code == "bad_field" and field in refused.value.text
