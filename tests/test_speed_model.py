import math
from typing import Any

import numpy as np
import pytest

from dynabatch.scheduler.speed_model import SpeedModel, StepModel

A = 0.02
C = 0.001


def _fitted(model: SpeedModel) -> StepModel:
    """The model's fit, which these tests' data always allows."""
    fit = model.fit()
    assert fit is not None, "no fit from the observations"
    return fit


def noisy_seconds(rng: np.random.Generator, a: float, c: float, batch: int) -> float:
    return (a + c * batch) * (1.0 + 0.05 * rng.standard_normal())


def test_step_model_predictions() -> None:
    m = StepModel(fixed_s=0.02, per_sample_s=0.001)
    assert m.step_seconds(100) == pytest.approx(0.12)
    assert m.samples_per_s(100) == pytest.approx(100 / 0.12)
    assert m.samples_per_s(200) > m.samples_per_s(100)
    with pytest.raises(ValueError):
        m.samples_per_s(0)


@pytest.mark.parametrize(
    "fixed, per_sample", [(-0.1, 0.001), (0.0, 0.0), (0.0, -1.0), (math.nan, 0.001), (0.0, math.inf)]
)
def test_step_model_rejects_invalid_parameters(fixed: float, per_sample: float) -> None:
    with pytest.raises(ValueError):
        StepModel(fixed, per_sample)


def test_nothing_known_gives_none() -> None:
    model = SpeedModel()
    assert model.fit() is None
    assert model.observations == 0


def test_prior_only_is_proportional() -> None:
    assert SpeedModel(prior_samples_per_s=250.0).fit() == StepModel(0.0, 1.0 / 250.0)


def test_observations_override_prior() -> None:
    model = SpeedModel(prior_samples_per_s=250.0)
    model.observe(100, 0.5)
    assert model.fit() == StepModel(0.0, 0.005)


def test_window_bounds_observations() -> None:
    model = SpeedModel(window=4)
    for _ in range(10):
        model.observe(64, 0.1)
    assert model.observations == 4


@pytest.mark.parametrize(
    "batch, seconds",
    [(0, 0.1), (-3, 0.1), (2.5, 0.1), ("64", 0.1), (64, 0.0), (64, -0.1), (64, math.nan), (64, math.inf)],
)
def test_invalid_observation_raises_and_changes_nothing(batch: object, seconds: float) -> None:
    model = SpeedModel()
    model.observe(64, 0.1)
    before = model.fit()
    with pytest.raises(ValueError):
        model.observe(batch, seconds)  # type: ignore[arg-type]
    assert model.observations == 1
    assert model.fit() == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0},
        {"forgetting": 0.0},
        {"forgetting": 1.5},
        {"prior_samples_per_s": 0.0},
        {"prior_samples_per_s": math.nan},
    ],
)
def test_invalid_construction_raises(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SpeedModel(**kwargs)


def test_exact_data_recovers_intercept_and_slope() -> None:
    model = SpeedModel()
    for i in range(10):
        batch = (32, 64, 128)[i % 3]
        model.observe(batch, A + C * batch)
    fit = _fitted(model)
    assert fit.fixed_s == pytest.approx(A, rel=1e-9)
    assert fit.per_sample_s == pytest.approx(C, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_data_recovers_intercept_and_slope(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = SpeedModel(window=64, forgetting=0.98)
    for i in range(200):
        batch = (16, 256)[i % 2]
        model.observe(batch, noisy_seconds(rng, A, C, batch))
    fit = _fitted(model)
    assert fit.fixed_s == pytest.approx(A, rel=0.1)
    assert fit.per_sample_s == pytest.approx(C, rel=0.1)


@pytest.mark.parametrize("seed", range(5))
def test_slowdown_shows_within_five_steps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = SpeedModel()
    for _ in range(16):
        model.observe(100, noisy_seconds(rng, A, C, 100))
    assert _fitted(model).step_seconds(100) < 0.14
    for _ in range(5):
        model.observe(100, noisy_seconds(rng, A, 2 * C, 100))
    assert _fitted(model).step_seconds(100) == pytest.approx(A + 2 * C * 100, rel=0.2)


@pytest.mark.parametrize("seed", range(5))
def test_slowdown_after_batches_moved_is_not_taken_for_fixed_cost(seed: int) -> None:
    """Old points at two batch sizes and new, slower ones at a third would fit a
    large intercept and an unchanged slope; the model must not remember that."""
    rng = np.random.default_rng(seed)
    model = SpeedModel()
    for i in range(30):
        batch = (64, 128)[i % 2]
        model.observe(batch, noisy_seconds(rng, A, C, batch))
    for _ in range(20):
        model.observe(96, noisy_seconds(rng, A, 2 * C, 96))
    fit = _fitted(model)
    assert fit.fixed_s < 0.05
    assert fit.per_sample_s > 1.5 * C


def test_intercept_kept_when_batches_stop_varying() -> None:
    model = SpeedModel()
    for i in range(20):
        batch = (32, 256)[i % 2]
        model.observe(batch, A + C * batch)
    for _ in range(40):
        model.observe(150, A + C * 150)
    fit = _fitted(model)
    assert fit.fixed_s == pytest.approx(A, rel=1e-9)
    assert fit.per_sample_s == pytest.approx(C, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_intercept_kept_when_batches_stop_varying(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = SpeedModel()
    for i in range(30):
        batch = (32, 256)[i % 2]
        model.observe(batch, noisy_seconds(rng, A, C, batch))
    for _ in range(40):
        model.observe(150, noisy_seconds(rng, A, C, 150))
    fit = _fitted(model)
    assert 0 < fit.fixed_s < 3 * A
    assert fit.step_seconds(150) == pytest.approx(A + C * 150, rel=0.1)


def test_kept_intercept_is_clamped_below_mean_step_time() -> None:
    model = SpeedModel()
    for i in range(20):
        batch = (100, 200)[i % 2]
        model.observe(batch, A + C * batch)
    for _ in range(20):
        model.observe(100, 0.01)
    fit = _fitted(model)
    assert fit.fixed_s == pytest.approx(0.9 * 0.01)
    assert fit.step_seconds(100) == pytest.approx(0.01)
    for _ in range(20):
        model.observe(100, A + C * 100)
    assert _fitted(model).fixed_s == pytest.approx(A)


def test_negative_intercept_is_clamped_to_zero() -> None:
    model = SpeedModel()
    for i in range(10):
        batch = (50, 100, 150)[i % 3]
        model.observe(batch, -0.01 + C * batch)
    fit = _fitted(model)
    assert fit.fixed_s == 0.0
    assert fit.per_sample_s > 0


def test_decreasing_times_fall_back_to_proportional() -> None:
    model = SpeedModel(forgetting=1.0)
    for batch, seconds in [(50, 0.3), (100, 0.2), (150, 0.1)]:
        model.observe(batch, seconds)
    fit = _fitted(model)
    assert fit.fixed_s == 0.0
    assert fit.per_sample_s == pytest.approx(0.2 / 100)


def test_reported_compute_time_gives_the_compute_cost_from_the_first_step() -> None:
    """150 ms of transfers and 6.4 ms of compute: the step fit cannot tell them apart at one batch size (its ``c``
    holds both), the reported compute time does at once."""
    model = SpeedModel(prior_samples_per_s=1000.0)
    model.observe(64, 0.150 + 64e-4, compute_s=64e-4)
    assert _fitted(model).fixed_s == 0.0 and _fitted(model).per_sample_s > 20 * 1e-4
    assert model.compute_fit() == StepModel(0.0, _compute(model)) and _compute(model) == pytest.approx(1e-4)


def test_compute_cost_weighs_the_newest_steps_most() -> None:
    model = SpeedModel(forgetting=0.5)
    model.observe(32, 0.2, compute_s=32 * 2e-4)
    model.observe(16, 0.2, compute_s=16 * 1e-4)
    expected = (0.5 * 32 * 2e-4 + 16 * 1e-4) / (0.5 * 32 + 16)
    assert _compute(model) == pytest.approx(expected)


def test_compute_cost_without_reported_compute_time_is_the_step_fits() -> None:
    assert SpeedModel().compute_fit() is None
    assert SpeedModel(prior_samples_per_s=500.0).compute_fit() == StepModel(0.0, 1.0 / 500.0)
    model = SpeedModel()
    for batch in (16, 32, 48, 64):
        model.observe(batch, 0.05 + 1e-3 * batch)
    assert _fitted(model).fixed_s == pytest.approx(0.05)
    assert _compute(model) == pytest.approx(1e-3)


@pytest.mark.parametrize("compute_s", [0.0, -1.0, math.nan, math.inf])
def test_a_bad_compute_time_is_refused_and_changes_nothing(compute_s: float) -> None:
    model = SpeedModel()
    model.observe(8, 0.1, compute_s=0.01)
    with pytest.raises(ValueError, match="compute_s"):
        model.observe(8, 0.1, compute_s=compute_s)
    assert model.observations == 1 and _compute(model) == pytest.approx(0.01 / 8)


def _compute(model: SpeedModel) -> float:
    fit = model.compute_fit()
    assert fit is not None
    return fit.per_sample_s


def test_the_overhead_fit_calls_the_time_spent_not_computing_fixed_from_the_first_step() -> None:
    """150 ms of transfers beside 6.4 ms of compute at one batch size: the step fit calls it all per-sample, the
    overhead fit calls the transfers fixed, and both predict the step at that batch."""
    model = SpeedModel(prior_samples_per_s=1000.0)
    assert model.overhead_fit() == model.fit(), "nothing reported yet: the prior"
    model.observe(64, 0.150 + 64e-4, compute_s=64e-4)
    fit = model.overhead_fit()
    assert fit is not None and fit.fixed_s == pytest.approx(0.150) and fit.per_sample_s == pytest.approx(1e-4)
    assert fit.step_seconds(64) == pytest.approx(_fitted(model).step_seconds(64))


def test_the_overhead_fits_fixed_part_is_the_transfers_and_the_probes_not_the_step_fits() -> None:
    """Batches that varied let the step fit find a fixed cost of 30 ms (10 ms of transfers, 20 ms of compute); a
    probe that found 5 ms of fixed compute makes the overhead fit's 15 ms whatever the step fit finds (its
    intercept moves with each window's noise), both predict the window's mean step, and without reported compute
    time the step fit is the only model."""
    model, older = SpeedModel(prior_fixed_s=0.005), SpeedModel()
    batches = (16, 32, 48, 64)
    for batch in batches:
        model.observe(batch, 0.010 + 0.020 + 1e-3 * batch, compute_s=0.020 + 1e-3 * batch)
        older.observe(batch, 0.030 + 1e-3 * batch)
    fit = model.overhead_fit()
    assert _fitted(model).fixed_s == pytest.approx(0.030)
    assert fit is not None and fit.fixed_s == pytest.approx(0.015), fit
    mean_batch = round(float(np.average(batches, weights=0.7 ** np.arange(3, -1, -1))))
    assert fit.step_seconds(mean_batch) == pytest.approx(_fitted(model).step_seconds(mean_batch), rel=0.02)
    assert older.overhead_fit() == _fitted(older)


def test_a_probes_large_fixed_cost_does_not_hide_a_slowdown_from_the_per_sample_cost() -> None:
    """A probe under contention may call most of a step fixed (here 90%); a worker that then slows down 1.6x at
    the same batch has its per-sample costs grow as much as a model without that prior sees them grow: the
    compute cost that sets an asgd split is the same, and the step fit's grows more (its kept intercept is
    seconds, not a fraction of the step)."""
    probed, plain = SpeedModel(16, 0.85, 48 / 0.05, prior_fixed_s=0.045), SpeedModel(16, 0.85, 48 / 0.05)
    growth = {}
    for name, model in (("probed", probed), ("plain", plain)):
        for _ in range(10):
            model.observe(48, 0.05, 0.05)
        compute, step = model.compute_fit(), _fitted(model)
        for _ in range(6):
            model.observe(48, 0.08, 0.08)
        slowed_compute, slowed_step = model.compute_fit(), _fitted(model)
        assert compute is not None and slowed_compute is not None
        growth[name] = (
            slowed_compute.per_sample_s / compute.per_sample_s,
            slowed_step.per_sample_s / step.per_sample_s,
        )
    assert growth["probed"][0] == pytest.approx(growth["plain"][0]) and growth["plain"][0] > 1.3
    assert growth["probed"][1] > growth["plain"][1], growth


def test_a_restart_predicts_the_new_protocols_step_from_compute_and_scaled_transfers_until_it_steps() -> None:
    """`restart` (a protocol switch): the step window empties, the model is the compute curve plus the old steps'
    time not computing scaled to the new protocol's transfers, and the compute per sample is kept; the first new
    step refits through it. A worker that reports no compute time keeps its model, which it cannot split so."""
    model = SpeedModel(prior_samples_per_s=1000.0, prior_fixed_s=0.01)
    for _ in range(8):
        model.observe(100, 0.51, compute_s=0.11)  # 0.4 s of each step transfers
    model.restart(1 / 8)
    assert model.observations == 0 and model.compute_fit() == StepModel(0.0, 0.11 / 100)
    fit = model.fit()
    assert fit is not None and math.isclose(fit.fixed_s, 0.01 + 0.4 / 8) and math.isclose(fit.per_sample_s, 0.001)
    model.observe(100, 0.2, compute_s=0.11)
    refit = model.fit()
    assert refit is not None and math.isclose(refit.step_seconds(100), 0.2) and math.isclose(refit.fixed_s, 0.06)
    silent = SpeedModel()
    silent.observe(100, 0.5)
    before = silent.fit()
    silent.restart(1 / 8)
    assert silent.fit() == before and silent.observations == 1
