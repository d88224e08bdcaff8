"""A step's times, as the worker reports them (common/wire/step_times.py, worker/heartbeats.py)."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.worker.heartbeats import heartbeat_after
from dynabatch.worker.step_result import StepResult


def test_a_local_rounds_phases_are_reported_per_step_with_the_step_their_sum() -> None:
    """A round of 4 local steps: each phase spread over the 4, the step the sum of them, so that the step less
    its wait for the round is one step of the worker's own work."""
    round_times = StepTimes(pull_s=0.4, compute_s=2.0, push_s=0.2, wait_s=0.8, data_s=0.1)
    one = round_times.per_step(4)
    expected = StepTimes(step_s=0.875, compute_s=0.5, pull_s=0.1, push_s=0.05, wait_s=0.2, data_s=0.025)
    assert astuple(one) == pytest.approx(astuple(expected))
    assert one.step_s - one.wait_s == pytest.approx((2.0 + 0.4 + 0.2 + 0.1) / 4)
    assert round_times.step_s == 0.0, "the loops' times are left as they were"


def test_a_heartbeat_after_a_round_carries_its_times_per_step_and_counts_every_step() -> None:
    prev = WorkerHeartbeat(steps=3, samples=96, standalone_sps=500.0)
    result = StepResult(StepTimes(pull_s=0.3, compute_s=0.9), batch=32, loss=1.5, version=7, steps=3)
    hb = heartbeat_after(prev, result, assignment_id=2)
    assert (hb.steps, hb.samples, hb.batch, hb.version, hb.standalone_sps) == (6, 192, 32, 7, 500.0)
    assert astuple(hb.times) == pytest.approx(astuple(StepTimes(step_s=0.4, compute_s=0.3, pull_s=0.1)))
