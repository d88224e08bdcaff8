import random

import numpy as np
import pytest

from dynabatch.common.protocols import SPECS
from dynabatch.scheduler.batch_allocation import (
    allocate,
    allocate_compute,
    allocate_round,
    allocation_for,
    bounds_note,
    fixed_allocation,
    needs_reassign,
    round_samples_per_s,
)
from dynabatch.scheduler.speed_model import StepModel


def reference_shares(
    models: dict[str, StepModel], total: int, b_min: int, b_max: int, caps: dict[str, int] | None = None
) -> dict[str, float]:
    """Real-valued equal-step-time shares by bisection on T, independent of the implementation."""
    a = np.array([m.fixed_s for m in models.values()])
    c = np.array([m.per_sample_s for m in models.values()])
    upper = np.array([min(b_max, (caps or {}).get(w, b_max)) for w in models])
    lower = np.minimum(b_min, upper)
    lo, hi = float((a + c * lower).min()), float((a + c * upper).max())
    for _ in range(200):
        t = 0.5 * (lo + hi)
        if np.clip((t - a) / c, lower, upper).sum() < total:
            lo = t
        else:
            hi = t
    return dict(zip(models, np.clip((0.5 * (lo + hi) - a) / c, lower, upper).tolist(), strict=True))


def test_proportional_speeds_give_proportional_batches() -> None:
    models = {"fast": StepModel(0.0, 1 / 400), "mid": StepModel(0.0, 1 / 200), "slow": StepModel(0.0, 1 / 100)}
    assert allocate(models, 700, 1, 1000) == {"fast": 400, "mid": 200, "slow": 100}
    assert allocate(models, 70, 1, 1000) == {"fast": 40, "mid": 20, "slow": 10}


def test_proportional_speeds_with_remainder_keep_sum() -> None:
    models = {"fast": StepModel(0.0, 1 / 400), "mid": StepModel(0.0, 1 / 200), "slow": StepModel(0.0, 1 / 100)}
    batches = allocate(models, 100, 1, 1000)
    assert sum(batches.values()) == 100
    for worker, share in {"fast": 400 / 7, "mid": 200 / 7, "slow": 100 / 7}.items():
        assert abs(batches[worker] - share) < 1


def test_fixed_costs_equalize_step_times() -> None:
    models = {
        "gpu": StepModel(0.05, 0.0002),
        "cpu-near": StepModel(0.01, 0.002),
        "cpu-far": StepModel(0.08, 0.002),
    }
    batches = allocate(models, 600, 1, 10_000)
    assert sum(batches.values()) == 600
    steps = {w: m.step_seconds(batches[w]) for w, m in models.items()}
    target = (600 + sum(m.fixed_s / m.per_sample_s for m in models.values())) / sum(
        1 / m.per_sample_s for m in models.values()
    )
    for worker, model in models.items():
        assert abs(steps[worker] - target) <= model.per_sample_s
    assert batches["cpu-near"] > batches["cpu-far"]


def test_clamping_pins_and_resolves_the_rest() -> None:
    models = {
        "a-very-fast": StepModel(0.0, 0.0001),
        "b-fast": StepModel(0.0, 0.001),
        "c-mid": StepModel(0.0, 0.002),
        "d-crawling": StepModel(0.0, 1.0),
    }
    batches = allocate(models, 400, 8, 200)
    assert sum(batches.values()) == 400
    assert batches["a-very-fast"] == 200
    assert batches["d-crawling"] == 8
    # the remaining 192 split 2:1 between the free workers
    assert batches["b-fast"] == 128
    assert batches["c-mid"] == 64


def test_lower_and_upper_bounds_in_one_solution_match_reference() -> None:
    """Pinning every violator of the first round at once would pin "c" at b_min here,
    although once "a" is capped it gets more than b_min."""
    models = {"a": StepModel(0.0, 0.0001), "b": StepModel(0.0, 0.01), "c": StepModel(0.0, 0.02)}
    batches = allocate(models, 100, 10, 60)
    reference = reference_shares(models, 100, 10, 60)
    assert batches == {"a": 60, "b": 27, "c": 13}
    for worker, share in reference.items():
        assert abs(batches[worker] - share) < 1


def test_random_allocations_keep_sum_bounds_and_match_reference() -> None:
    rng = random.Random(1234)
    for _ in range(500):
        n = rng.randint(1, 12)
        models = {
            f"w{i:02d}": StepModel(rng.choice([0.0, rng.uniform(0, 0.2)]), rng.uniform(1e-5, 1e-2)) for i in range(n)
        }
        b_min = rng.randint(1, 32)
        b_max = rng.randint(b_min, 512)
        total = rng.randint(n * b_min, n * b_max)
        batches = allocate(models, total, b_min, b_max)
        assert set(batches) == set(models)
        assert sum(batches.values()) == total
        assert all(b_min <= b <= b_max and isinstance(b, int) for b in batches.values())
        for worker, share in reference_shares(models, total, b_min, b_max).items():
            assert abs(batches[worker] - share) < 1 + 1e-6


def test_infeasible_global_batch_clamps_everyone() -> None:
    models = {"a": StepModel(0.0, 0.001), "b": StepModel(0.0, 0.002), "c": StepModel(0.01, 0.01)}
    assert allocate(models, 20, 16, 128) == {"a": 16, "b": 16, "c": 16}
    assert allocate(models, 1000, 16, 128) == {"a": 128, "b": 128, "c": 128}
    assert allocate(models, 48, 16, 128) == {"a": 16, "b": 16, "c": 16}


def test_empty_models_give_empty_allocation() -> None:
    assert allocate({}, 128, 1, 128) == {}
    assert fixed_allocation([], 128, 1, 128) == {}


@pytest.mark.parametrize("total, b_min, b_max", [(-1, 1, 10), (10, 0, 10), (10, 5, 4)])
def test_invalid_bounds_raise(total: int, b_min: int, b_max: int) -> None:
    with pytest.raises(ValueError):
        allocate({"a": StepModel(0.0, 0.001)}, total, b_min, b_max)
    with pytest.raises(ValueError):
        fixed_allocation(["a"], total, b_min, b_max)


def test_ties_break_by_worker_id_regardless_of_order() -> None:
    same = StepModel(0.01, 0.001)
    forward = allocate({"w1": same, "w2": same, "w3": same}, 11, 1, 100)
    backward = allocate({"w3": same, "w2": same, "w1": same}, 11, 1, 100)
    assert forward == backward == {"w1": 4, "w2": 4, "w3": 3}


def test_fixed_allocation_gives_remainder_to_first_ids() -> None:
    assert fixed_allocation(["c", "a", "b"], 11, 1, 100) == {"a": 4, "b": 4, "c": 3}
    assert fixed_allocation(["x", "y"], 64, 1, 100) == {"x": 32, "y": 32}
    assert fixed_allocation(["x", "y"], 10, 8, 100) == {"x": 8, "y": 8}
    assert fixed_allocation(["x", "y"], 500, 8, 100) == {"x": 100, "y": 100}


def test_fixed_allocation_keeps_sum() -> None:
    rng = random.Random(99)
    for _ in range(200):
        workers = [f"w{i}" for i in range(rng.randint(1, 20))]
        total = rng.randint(len(workers), 50 * len(workers))
        batches = fixed_allocation(workers, total, 1, 50)
        assert sum(batches.values()) == total
        assert max(batches.values()) - min(batches.values()) <= 1


def test_needs_reassign_ignores_small_changes() -> None:
    current = {"a": 100, "b": 50}
    assert not needs_reassign(current, {"a": 100, "b": 50}, 0.1)
    assert not needs_reassign(current, {"a": 109, "b": 46}, 0.1)
    assert not needs_reassign(current, {"a": 110, "b": 45}, 0.1)
    assert needs_reassign(current, {"a": 100, "b": 44}, 0.1)
    assert needs_reassign(current, {"a": 111, "b": 50}, 0.1)


def test_needs_reassign_when_workers_change() -> None:
    current = {"a": 100, "b": 50}
    assert needs_reassign(current, {"a": 100, "b": 50, "c": 1}, 0.5)
    assert needs_reassign(current, {"a": 100}, 0.5)
    assert needs_reassign({}, {"a": 100}, 0.5)
    assert not needs_reassign({}, {}, 0.5)


def test_needs_reassign_rejects_negative_threshold() -> None:
    with pytest.raises(ValueError):
        needs_reassign({"a": 1}, {"a": 1}, -0.1)


# ---------------------------------------------------------------- per-worker caps (a worker's own --max-batch)


def test_a_capped_fast_worker_keeps_its_cap_and_the_rest_is_resolved_among_the_others() -> None:
    models = {"fast": StepModel(0.0, 1 / 400), "mid": StepModel(0.0, 1 / 200), "slow": StepModel(0.0, 1 / 100)}
    assert allocate(models, 700, 1, 1000) == {"fast": 400, "mid": 200, "slow": 100}
    capped = allocate(models, 700, 1, 1000, caps={"fast": 100})
    assert capped == {"fast": 100, "mid": 400, "slow": 200}, "mid and slow share 600 at their 2:1 speeds"
    assert bounds_note(capped, 700) == ""


def test_a_cap_never_raises_a_bound_and_wins_over_the_jobs_smallest_batch() -> None:
    models = {"a": StepModel(0.0, 0.001), "b": StepModel(0.0, 0.001)}
    assert allocate(models, 100, 8, 60, caps={"a": 500}) == {"a": 50, "b": 50}
    assert allocate(models, 100, 8, 200, caps={"a": 4}) == {"a": 4, "b": 96}
    assert fixed_allocation(["a", "b"], 100, 8, 200, caps={"a": 4}) == {"a": 4, "b": 96}


def test_caps_that_cannot_hold_the_global_batch_give_everyone_their_cap_and_say_so() -> None:
    models = {"a": StepModel(0.0, 0.001), "b": StepModel(0.01, 0.002), "c": StepModel(0.0, 0.01)}
    caps = {"a": 32, "b": 16}
    batches = allocate(models, 200, 8, 64, caps)
    assert batches == {"a": 32, "b": 16, "c": 64}
    assert fixed_allocation(list(models), 200, 8, 64, caps) == batches
    assert bounds_note(batches, 200) == "bounds hold less than B"
    assert bounds_note(fixed_allocation(["a", "b"], 10, 8, 64), 10) == "bounds hold more than B"
    assert bounds_note({}, 10) == ""


def test_fixed_allocation_fills_equal_shares_around_capped_workers() -> None:
    assert fixed_allocation(["a", "b", "c"], 96, 8, 1024, caps={"a": 16}) == {"a": 16, "b": 40, "c": 40}
    assert fixed_allocation(["a", "b", "c"], 97, 8, 1024, caps={"c": 16}) == {"a": 41, "b": 40, "c": 16}
    assert fixed_allocation(["a", "b", "c"], 96, 8, 1024, caps={"a": 16, "b": 30}) == {"a": 16, "b": 30, "c": 50}
    assert fixed_allocation(["a", "b", "c"], 96, 8, 1024, caps={"a": 64}) == {"a": 32, "b": 32, "c": 32}


def _equal_but_for_bounds(batches: dict[str, int], lower: dict[str, int], upper: dict[str, int], b_max: int) -> bool:
    """Some level puts every batch at that level or one more, once clipped to the worker's bounds."""
    return any(
        all(
            b in (np.clip(level, lower[w], upper[w]), np.clip(level + 1, lower[w], upper[w]))
            for w, b in batches.items()
        )
        for level in range(b_max + 1)
    )


def test_random_capped_allocations_keep_sum_and_bounds_and_match_reference() -> None:
    rng = random.Random(4321)
    for _ in range(500):
        n = rng.randint(1, 10)
        ids = [f"w{i:02d}" for i in range(n)]
        models = {w: StepModel(rng.choice([0.0, rng.uniform(0, 0.2)]), rng.uniform(1e-5, 1e-2)) for w in ids}
        b_min = rng.randint(1, 16)
        b_max = rng.randint(b_min, 256)
        caps = {w: rng.randint(1, 300) for w in ids if rng.random() < 0.5}
        upper = {w: min(b_max, caps.get(w, b_max)) for w in ids}
        lower = {w: min(b_min, upper[w]) for w in ids}
        total = rng.randint(sum(lower.values()), sum(upper.values()))
        for batches in (allocate(models, total, b_min, b_max, caps), fixed_allocation(ids, total, b_min, b_max, caps)):
            assert sum(batches.values()) == total
            assert all(lower[w] <= b <= upper[w] and isinstance(b, int) for w, b in batches.items())
        dynamic = allocate(models, total, b_min, b_max, caps)
        for worker, share in reference_shares(models, total, b_min, b_max, caps).items():
            assert abs(dynamic[worker] - share) < 1 + 1e-6
        fixed = fixed_allocation(ids, total, b_min, b_max, caps)

        assert _equal_but_for_bounds(fixed, lower, upper, b_max), ("equal shares but for the bounds", fixed)


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="caps"):
        allocate({"a": StepModel(0.0, 0.001)}, 10, 1, 100, caps={"a": 0})
    with pytest.raises(ValueError, match="caps"):
        fixed_allocation(["a"], 10, 1, 100, caps={"a": -3})


def test_a_worker_whose_fixed_cost_alone_exceeds_the_round_gets_batch_0() -> None:
    """LB-BSP gives the 8x workers at least b_min, and every round waits for them; without them it is 2.5x faster."""
    models = {f"w{i:02d}": StepModel(0.004, 0.0005) for i in range(12)}
    models.update({f"w{i:02d}": StepModel(0.032 * 5, 0.004) for i in range(12, 16)})  # a_i = 160 ms alone
    everyone = allocate(models, 512, 8, 1024)
    round_ = allocate_round(models, 512, 8, 1024)
    assert all(everyone[w] == 8 for w in list(models)[12:]), "allocate pins them at b_min"
    assert [round_[w] for w in list(models)[12:]] == [0, 0, 0, 0]
    assert sum(round_.values()) == 512 and all(round_[w] > 0 for w in list(models)[:12])
    t_round = max(models[w].step_seconds(b) for w, b in round_.items() if b > 0)
    assert all(models[w].fixed_s > t_round for w in list(models)[12:]), "each one's fixed cost alone exceeds it"
    assert round_samples_per_s(models, round_) > 2 * round_samples_per_s(models, everyone)


def test_round_allocation_keeps_everyone_when_leaving_out_gains_little() -> None:
    models = {"a": StepModel(0.004, 0.0005), "b": StepModel(0.004, 0.0006), "c": StepModel(0.005, 0.0007)}
    assert allocate_round(models, 96, 8, 1024) == allocate(models, 96, 8, 1024)
    assert allocate_round({"a": StepModel(1.0, 0.1)}, 16, 1, 64) == {"a": 16}, "one worker is always kept"
    assert allocate_round({}, 16, 1, 64) == {}


def test_round_allocation_leaves_out_only_workers_slower_than_the_round_they_hold_up() -> None:
    """Speeds 1, 1, 1, 2, 3, 5, 9, 20x: the three slowest hold up the round even at one sample; the 3x does not."""
    factors = [1, 1, 1, 2, 3, 5, 9, 20]
    models = {f"w{i}": StepModel(0.004 * f, 0.0005 * f) for i, f in enumerate(factors)}
    batches = allocate_round(models, 64, 1, 1024)
    assert [batches[f"w{i}"] for i in range(5, 8)] == [0, 0, 0]
    assert all(batches[f"w{i}"] >= 1 for i in range(5)) and sum(batches.values()) == 64
    t_round = max(models[w].step_seconds(b) for w, b in batches.items() if b > 0)
    assert all(models[f"w{i}"].step_seconds(1) > t_round for i in range(5, 8))


# A worker behind a 100 Mbit link among 1 Gbit ones (bench/links.py): as fast to compute, but its pull and push of
# the model take ~150 ms, which the speed model sees as fixed cost.
FAST_LINK = StepModel(0.01, 1 / 1000)
SLOW_LINK = StepModel(0.15, 1 / 1000)
LINKS = {"fast-0": FAST_LINK, "fast-1": FAST_LINK, "slow-0": SLOW_LINK}


def samples_per_s(models: dict[str, StepModel], batches: dict[str, int]) -> float:
    """What workers stepping independently (nothing waits) train together."""
    return sum(models[w].samples_per_s(b) for w, b in batches.items() if b > 0)


def test_a_slow_link_keeps_its_compute_share_where_no_step_waits() -> None:
    equal_steps = allocate(LINKS, 192, 1, 1024)
    compute = allocate_compute(LINKS, 192, 1, 1024)
    assert equal_steps["slow-0"] < 10, equal_steps  # the equal-time split starves it
    assert compute == {"fast-0": 64, "fast-1": 64, "slow-0": 64}  # equal compute speeds, equal shares
    assert samples_per_s(LINKS, compute) > 1.1 * samples_per_s(LINKS, equal_steps)  # 2029 against 1817
    assert LINKS["slow-0"].samples_per_s(compute["slow-0"]) > 5 * LINKS["slow-0"].samples_per_s(equal_steps["slow-0"])


def test_compute_shares_follow_compute_speed_not_the_link() -> None:
    models = {"fast": StepModel(0.2, 1 / 400), "slow": StepModel(0.001, 1 / 100)}  # the faster one on a slow link
    assert allocate_compute(models, 500, 1, 1024) == {"fast": 400, "slow": 100}
    assert allocate(models, 500, 1, 1024)["fast"] < 400


def test_compute_shares_keep_the_bounds_caps_and_sum() -> None:
    rng = random.Random(7)
    for _ in range(200):
        models = {f"w{i}": StepModel(rng.uniform(0, 0.3), rng.uniform(1e-4, 1e-2)) for i in range(rng.randint(1, 8))}
        caps = {w: rng.randint(1, 200) for w in models if rng.random() < 0.3}
        b_min, b_max = rng.randint(1, 16), rng.randint(16, 256)
        total = rng.randint(0, 600)
        got = allocate_compute(models, total, b_min, b_max, caps)
        expected = allocate({w: StepModel(0.0, m.per_sample_s) for w, m in models.items()}, total, b_min, b_max, caps)
        assert got == expected
        for w, b in got.items():
            hi = min(b_max, caps.get(w, b_max))
            assert min(b_min, hi) <= b <= hi


@pytest.mark.parametrize("protocol", sorted(SPECS))
def test_each_protocol_gets_the_split_of_its_objective(protocol: str) -> None:
    """Where a slower step costs the others (a round waits, ssp holds back, ringmaster discards), the slow link
    still gets the equal-time batch; where nothing waits (asgd, softsync), its compute share."""
    spec = SPECS[protocol]
    batches = allocation_for(spec)(LINKS, 192, 1, 1024, None)
    if spec.sized_rounds:
        assert batches == allocate_round(LINKS, 192, 1, 1024)
    elif spec.equal_steps:
        assert batches == allocate(LINKS, 192, 1, 1024)
        assert batches["slow-0"] < 10
    else:
        assert protocol in ("asgd", "softsync")
        assert batches["slow-0"] == 64
