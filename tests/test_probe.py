"""The worker's start-up probe of two batch sizes (common/probe.py) and what the scheduler makes of it: a device's
fixed cost per step known before its first step, kept while a fixed split never varies the batch."""

from __future__ import annotations

import pytest

from dynabatch.common.probe import PROBE_BATCH, fixed_cost, probe_steps, probed, small_probe_batch
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import WorkerHeartbeat
from dynabatch.scheduler.report_bounds import check_worker_heartbeat
from dynabatch.scheduler.speed_model import SpeedModel


def test_two_batch_sizes_give_the_fixed_cost_of_a_step() -> None:
    a, c = 0.03, 2e-4
    small = small_probe_batch(PROBE_BATCH)
    assert 0 < small < PROBE_BATCH
    assert fixed_cost(small, a + c * small, PROBE_BATCH, a + c * PROBE_BATCH) == pytest.approx(a)
    assert fixed_cost(small, c * small, PROBE_BATCH, c * PROBE_BATCH) == pytest.approx(0.0, abs=1e-12)
    # noise of a loaded machine: a small batch measured slower than the large one is all fixed cost, no more than
    # the large one's step, which the scheduler's bound on a probe is (two suites side by side stalled a small batch
    # to 18 times the large one's median, and the scheduler refused that worker's every report)
    assert fixed_cost(small, 0.05, PROBE_BATCH, 0.04) == 0.04
    stalled = fixed_cost(small, 0.0087, PROBE_BATCH, PROBE_BATCH / 129_769)
    assert stalled == PROBE_BATCH / 129_769
    check_worker_heartbeat(
        WorkerHeartbeat(), WorkerHeartbeat(standalone_sps=129_769.0, standalone_fixed_s=stalled), 1.0, 1024, 1
    )
    assert small_probe_batch(3) == 0, "too small a batch to probe twice"
    assert small_probe_batch(4) == 0 and small_probe_batch(8) == 2, "no probe below the floor of a batch (2)"


def test_the_probes_fixed_cost_is_the_speed_models_intercept_under_a_fixed_batch() -> None:
    a, c, batch = 0.02, 1e-3, 32  # a fixed cost of 40% of the step (the model keeps a below 90%)
    plain, probed = SpeedModel(16, 0.85, 64 / (a + c * 64)), SpeedModel(16, 0.85, 64 / (a + c * 64), a)
    for _ in range(8):
        plain.observe(batch, a + c * batch)
        probed.observe(batch, a + c * batch)
    unprobed = plain.fit()
    assert unprobed is not None and unprobed.fixed_s == 0.0, "one batch size alone cannot show it"
    fit = probed.fit()
    assert fit is not None and fit.fixed_s == pytest.approx(a) and fit.per_sample_s == pytest.approx(c)
    assert fit.step_seconds(96) == pytest.approx(a + c * 96), "so a step at another batch is predicted"
    with pytest.raises(ValueError, match="prior_fixed_s"):
        SpeedModel(16, 0.85, 100.0, -1.0)


@pytest.mark.parametrize("fixed_s", [-0.1, float("nan"), 10.0])
def test_a_probe_claiming_a_fixed_cost_longer_than_its_step_is_refused(fixed_s: float) -> None:
    hb = WorkerHeartbeat(standalone_sps=1000.0, standalone_fixed_s=fixed_s)  # 1,000 samples/s: 0.064 s a probe
    with pytest.raises(ProtocolError, match="standalone_fixed_s"):
        check_worker_heartbeat(WorkerHeartbeat(), hb, 1.0, 1024, 1)
    check_worker_heartbeat(
        WorkerHeartbeat(), WorkerHeartbeat(standalone_sps=1000.0, standalone_fixed_s=0.05), 1, 1024, 1
    )


def test_the_probes_fixed_cost_is_read_as_the_share_of_its_own_step_so_a_slowed_probe_gives_the_true_one() -> None:
    """A probe at batch 64 slowed 2.5x (40% of its step fixed, as unslowed) gives the true fixed seconds once the
    steps show the worker's own pace; without its batch, the probe's seconds stand as measured."""
    a, c, slowed, batch = 0.02, 1e-3, 2.5, 40
    probe_s = slowed * (a + c * PROBE_BATCH)
    scaled = SpeedModel(16, 0.85, PROBE_BATCH / probe_s, slowed * a, probe_batch=PROBE_BATCH)
    as_seconds = SpeedModel(16, 0.85, PROBE_BATCH / probe_s, slowed * a)
    for model in (scaled, as_seconds):
        for _ in range(4):
            model.observe(batch, 0.01 + a + c * batch, a + c * batch)
    curve, unscaled = scaled.compute_curve(), as_seconds.compute_curve()
    assert curve is not None and curve.fixed_s == pytest.approx(a) and curve.per_sample_s == pytest.approx(c)
    assert unscaled is not None and unscaled.fixed_s == pytest.approx(slowed * a)


def test_the_probe_takes_its_two_batches_in_turn_and_reads_each_by_its_median() -> None:
    """In turn, so that load that comes and goes meets both batches; a probe slowed by a factor throughout reads the
    fixed cost times that factor and the speed over it (the share the scheduler takes, above), whatever one
    step's stall."""
    steps = probe_steps(PROBE_BATCH, 3)
    small = small_probe_batch(PROBE_BATCH)
    assert steps == [PROBE_BATCH, small] * 3
    assert probe_steps(3, 3) == [3, 3, 3], "no small batch: the large one alone"
    a, c, slowed = 0.02, 1e-3, 2.0
    seconds = [slowed * (a + c * b) for b in steps]
    seconds[2] *= 10  # one stalled step: the medians leave it out
    speed, fixed_s = probed(steps, seconds)
    assert speed == pytest.approx(PROBE_BATCH / (slowed * (a + c * PROBE_BATCH)))
    assert fixed_s == pytest.approx(slowed * a)
    assert probed(probe_steps(3, 3), [0.01, 0.02, 0.03]) == pytest.approx((3 / 0.02, 0.0))
