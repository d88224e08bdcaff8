"""The optimum every method is judged against (common/planning/optimum.py): its formulas on figures worked by hand."""

from __future__ import annotations

import pytest

from bench.reference_time import cluster_optimum, device_of
from bench.simulate import WorkerSpec
from dynabatch.common.planning.optimum import (
    PER_WORKER_BATCHES,
    Device,
    NoiseScale,
    calibrated_optimum,
    fit_steps_to_target,
    optimal_time,
    single_machine_time,
)


def test_the_fit_recovers_k_min_and_b_noise_from_steps_at_three_batches() -> None:
    truth = NoiseScale(k_min=500.0, b_noise=128.0)
    fit = fit_steps_to_target([32, 128, 512], [truth.steps(b) for b in (32, 128, 512)])  # 2500, 1000, 625
    assert (fit.k_min, fit.b_noise) == pytest.approx((500.0, 128.0))
    assert fit.samples(128) == pytest.approx(1000 * 128)


@pytest.mark.parametrize(
    "batches, steps, message",
    [
        ([64], [100], "two or more"),
        ([64, 64], [100, 90], "two or more"),
        ([32, 128], [100, 300], "do not fall"),  # more steps at a larger batch
        ([32, 0], [100, 50], "positive"),
    ],
)
def test_a_fit_that_cannot_be_the_model_is_refused(batches: list[int], steps: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_steps_to_target(batches, steps)


def test_t_star_leaves_out_a_slow_worker_when_the_noise_is_small_and_takes_it_when_large() -> None:
    """Speeds 10, 10, 1 samples/s, one sample each per step: with B_noise 10, m = 2 gives (2 + 10) / 20 = 0.6
    against (3 + 10) / 21 = 0.619; with B_noise 100, m = 3 gives 103 / 21 = 4.90 against 102 / 20 = 5.1."""
    small = optimal_time(NoiseScale(1.0, 10.0), [1.0, 10.0, 10.0])
    assert small.time_s == pytest.approx(0.6) and small.workers == 2
    large = optimal_time(NoiseScale(2.0, 100.0), [1.0, 10.0, 10.0])
    assert large.time_s == pytest.approx(2 * 103 / 21) and large.workers == 3


def test_the_calibrated_optimum_weighs_each_batch_against_fixed_costs_and_caps() -> None:
    """A GPU (0.1 s fixed, 0.001 s a sample, cap 200) and a CPU (no fixed cost, 0.01 s a sample): at b = 1 the
    GPU runs 9.9 samples/s, at b = 200 it runs 666.7; the CPU 100 at any batch, but a b of 400 is past the GPU's
    cap. K_min 10, B_noise 5000 (at B_noise 1000 the GPU alone would be faster: 1200 / 666.7 against 1400 / 766.7)."""
    noise = NoiseScale(10.0, 5000.0)
    gpu, cpu = Device(0.1, 0.001, max_batch=200), Device(0.0, 0.01)
    assert gpu.seconds(200) == pytest.approx(0.3) and gpu.speed(1) == pytest.approx(1 / 0.101)
    best = calibrated_optimum(noise, [gpu, cpu], [1, 200, 400])
    assert (best.batch, best.workers) == (200, 2)
    assert best.time_s == pytest.approx(10 * (2 * 200 + 5000) / (200 / 0.3 + 100))
    only_cpu = calibrated_optimum(noise, [gpu, cpu], [400])
    assert only_cpu.workers == 1 and only_cpu.time_s == pytest.approx(10 * 5400 / 100)
    with pytest.raises(ValueError, match="no worker"):
        calibrated_optimum(noise, [gpu], [400])


def test_a_single_machine_as_fast_as_the_cluster_needs_k_of_b_times_b_samples() -> None:
    assert single_machine_time(NoiseScale(100.0, 50.0), 150, speed=1000.0) == pytest.approx(100 * 200 / 1000)


def test_a_simulated_clusters_t_star_takes_each_starting_workers_curve_slowdown_and_cap() -> None:
    slowed = WorkerSpec("2:0.01", max_batch=64)  # the cluster's curve, twice as slow, 0.01 s more a step
    own = WorkerSpec(fixed_s=0.1, per_sample_s=0.001, max_batch=200)
    assert device_of(slowed, 0.004, 0.0005) == Device(0.004 * 2 + 0.01, 0.001, 64)
    assert device_of(own, 0.004, 0.0005) == Device(0.1, 0.001, 200)
    noise = NoiseScale(50.0, 500.0)
    joiner = WorkerSpec("1", join_s=5.0)  # not in the cluster that starts
    expected = calibrated_optimum(noise, [Device(0.018, 0.001, 64), Device(0.1, 0.001, 200)], PER_WORKER_BATCHES)
    assert cluster_optimum([slowed, own, joiner], 0.004, 0.0005, noise) == expected
