"""The efficient batch policy's rule (scheduler/efficient_batches.py), driven directly: each worker's knee, its cap,
the slow link's transfers amortised, and the batches summing to B on either side of the knees' sum."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dynabatch.scheduler.batch_allocation import needs_reassign
from dynabatch.scheduler.efficient_batches import FIXED_SHARE, efficient_batches, knee
from dynabatch.scheduler.speed_model import SpeedModel, StepModel

FAST_GPU = StepModel(0.010, 0.0001)  # its fixed cost is 100 samples' compute: efficient only at large batches
SLOW_GPU = StepModel(0.005, 0.002)  # 2.5 samples'
SLOW_LINK = StepModel(0.050, 0.001)  # 10 ms of compute overhead and 40 ms of transfers each step


def _fixed_share(model: StepModel, batch: int) -> float:
    return model.fixed_s / model.step_seconds(batch)


def test_the_knee_is_where_the_fixed_cost_falls_to_its_share_of_the_step() -> None:
    assert knee(FAST_GPU) == pytest.approx(900.0)
    assert _fixed_share(FAST_GPU, 900) == pytest.approx(FIXED_SHARE)
    assert FAST_GPU.samples_per_s(900) == pytest.approx((1 - FIXED_SHARE) / FAST_GPU.per_sample_s)
    assert knee(SLOW_GPU) == pytest.approx(22.5)
    assert knee(StepModel(0.0, 0.001)) == 0.0, "no fixed cost: efficient at any batch"
    assert knee(FAST_GPU, 0.5) == pytest.approx(100.0)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="fixed_share"):
            knee(FAST_GPU, bad)


def test_when_b_holds_every_knee_each_worker_gets_at_least_its_knee_and_the_rest_equal_compute_time() -> None:
    models = {"fast": FAST_GPU, "slow": SLOW_GPU, "link": SLOW_LINK}
    batches = efficient_batches(models, 2100, 8, 4096)
    assert sum(batches.values()) == 2100
    assert all(batches[w] >= int(knee(m)) for w, m in models.items())
    # the slow link's knee (450) is more than its equal-compute-time share: it keeps its knee, and the two GPUs
    # split the rest at equal compute time, the fast one 20 times the slow one's batch (its c is a twentieth)
    assert batches["link"] == 450
    assert batches["fast"] * FAST_GPU.per_sample_s == pytest.approx(batches["slow"] * SLOW_GPU.per_sample_s, rel=0.02)


def test_when_b_cannot_hold_the_knees_every_worker_gets_the_same_fixed_share_of_its_step() -> None:
    models = {"fast": FAST_GPU, "slow": SLOW_GPU, "link": SLOW_LINK}
    batches = efficient_batches(models, 600, 1, 4096)
    assert sum(batches.values()) == 600
    shares = [_fixed_share(m, batches[w]) for w, m in models.items()]
    assert max(shares) - min(shares) < 0.02, shares
    assert batches["fast"] > batches["link"] > batches["slow"]
    equal = {w: 200 for w in models}
    rate = sum(m.samples_per_s(batches[w]) for w, m in models.items())
    assert rate > 1.1 * sum(m.samples_per_s(equal[w]) for w, m in models.items()), "beats equal shares"


def test_a_slow_link_is_amortised_over_a_larger_batch() -> None:
    """Two workers that compute alike, one behind a link that adds 40 ms of transfers to every step: its fixed
    cost is five times the other's, and so is its batch, within B."""
    near, far = StepModel(0.010, 0.001), SLOW_LINK
    batches = efficient_batches({"near": near, "far": far}, 120, 1, 4096)
    assert batches == {"near": 20, "far": 100}
    assert _fixed_share(far, batches["far"]) == pytest.approx(_fixed_share(near, batches["near"]))


def test_a_cap_holds_its_worker_and_the_others_take_the_rest() -> None:
    models = {"fast": FAST_GPU, "slow": SLOW_GPU}
    capped = efficient_batches(models, 600, 8, 4096, caps={"fast": 256})
    assert capped == {"fast": 256, "slow": 344}
    assert efficient_batches(models, 600, 8, 300) == {"fast": 300, "slow": 300}, "the job's --max-batch too"


def test_bounds_that_cannot_hold_b_win_and_nothing_is_an_error() -> None:
    models = {"fast": FAST_GPU, "slow": SLOW_GPU}
    assert efficient_batches(models, 4, 8, 64) == {"fast": 8, "slow": 8}
    assert efficient_batches(models, 1000, 8, 64) == {"fast": 64, "slow": 64}
    assert efficient_batches({}, 100, 8, 64) == {}
    with pytest.raises(ValueError, match="b_max"):
        efficient_batches(models, 100, 8, 4)


def test_random_clusters_keep_the_sum_the_bounds_and_the_knees() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 12)
        models = {
            f"w{i}": StepModel(rng.choice([0.0, rng.uniform(1e-4, 0.1)]), rng.uniform(1e-5, 1e-2)) for i in range(n)
        }
        caps = {w: rng.randint(1, 2000) for w in models if rng.random() < 0.3}
        b_min, b_max = rng.randint(1, 16), rng.randint(16, 4096)
        total = rng.randint(n * min(b_min, 4), n * 512)
        batches = efficient_batches(models, total, b_min, b_max, caps)
        hi = {w: min(b_max, caps.get(w, b_max)) for w in models}
        lo = {w: min(b_min, hi[w]) for w in models}
        assert all(lo[w] <= batches[w] <= hi[w] for w in models)
        if sum(lo.values()) <= total <= sum(hi.values()):
            assert sum(batches.values()) == total
        knees = {w: min(hi[w], max(lo[w], knee(m))) for w, m in models.items()}
        if sum(knees.values()) <= total:
            assert all(batches[w] >= int(knees[w]) for w in models)


def _replayed_batches(seed: int, steps: int, contention: float = 1.0) -> list[int]:
    """Worker w0's batch after each of `steps` steps of three workers under the efficient split, as the scheduler
    runs it: every step (log-normal noise of 20% on its compute and its 20 ms of transfers) goes into its worker's
    SpeedModel, the split is solved from their `overhead_fit`s and taken past the 10% hysteresis. w0's compute has
    a fixed 20 ms (`--slowdowns 1:0.02`) that its probe at batch 64 found, slowed by `contention` (both its
    batches alike, as processes starting beside it do: its fixed seconds overstated, its speed understated, by that
    factor); w2 computes at half w1's speed."""
    rng = np.random.default_rng(seed)
    compute = {"w0": StepModel(0.020, 1e-3), "w1": StepModel(0.0, 1e-3), "w2": StepModel(0.0, 2e-3)}
    slowed = {"w0": contention, "w1": 1.0, "w2": 1.0}
    speeds = {
        w: SpeedModel(16, 0.85, 64 / m.step_seconds(64) / slowed[w], m.fixed_s * slowed[w], probe_batch=64)
        for w, m in compute.items()
    }
    batches = dict.fromkeys(compute, 32)
    replayed = []
    for _ in range(steps):
        for w, model in compute.items():
            compute_s = model.step_seconds(batches[w]) * rng.lognormal(0.0, 0.2)
            speeds[w].observe(batches[w], compute_s + 0.020 * rng.lognormal(0.0, 0.2), compute_s)
        fits = {w: speed.overhead_fit() for w, speed in speeds.items()}
        proposed = efficient_batches({w: fit for w, fit in fits.items() if fit is not None}, 96, 8, 1024)
        batches = proposed if needs_reassign(batches, proposed, 0.1) else batches
        replayed.append(batches["w0"])
    return replayed


TRUE_STEPS = {"w0": StepModel(0.040, 1e-3), "w1": StepModel(0.020, 1e-3), "w2": StepModel(0.020, 2e-3)}
"""The replayed workers' true steps, transfers included: the reference split."""


@pytest.mark.parametrize("seed", range(3))
def test_a_fixed_compute_cost_keeps_its_worker_near_its_knee_split_on_noisy_steps(seed: int) -> None:
    """The fixed compute cost is the probe's from the first step, whatever the step fit's intercept does as the
    batch varies: w0's batch stays near where the true step models put it (after 20 steps to fill the window),
    not where its fixed 20 ms is read as per-sample cost, nor jumping between the two as the step fit's intercept,
    identified now and then from the noise, comes and goes."""
    target = efficient_batches(TRUE_STEPS, 96, 8, 1024)["w0"]
    replayed = _replayed_batches(seed, 200)[20:]
    assert all(abs(b - target) <= 0.25 * target for b in replayed), (target, min(replayed), max(replayed))


@pytest.mark.parametrize(("seed", "contention"), [(s, f) for s in range(3) for f in (2.0, 3.0)])
def test_a_probe_slowed_at_start_up_still_settles_its_worker_near_the_true_split(seed: int, contention: float) -> None:
    """A probe slowed 2x or 3x by start-up contention overstates w0's fixed seconds as much (40 or 60 ms, which as
    seconds would put w0 at 66 to 77, past the 25% band): read as the fraction of the probe's step it is, the same
    fixed cost as an unslowed probe's, its batch settles near the true split as an unslowed probe's does."""
    target = efficient_batches(TRUE_STEPS, 96, 8, 1024)["w0"]
    replayed = _replayed_batches(seed, 200, contention)[20:]
    assert all(abs(b - target) <= 0.25 * target for b in replayed), (target, min(replayed), max(replayed))
    assert abs(float(np.mean(replayed)) - target) <= 0.1 * target, (target, float(np.mean(replayed)))
