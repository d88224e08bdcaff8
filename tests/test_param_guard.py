"""The shard's parameter guard (ps/param_guard.py), directly: what it calls healthy, broken and exploding."""

from __future__ import annotations

import math

import torch

from dynabatch.ps.param_guard import EXPLODE_FACTOR, FLOOR_RMS, ParamGuard


def _model(seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {0: torch.randn(1000, generator=g) * 0.05, 1: torch.randn(500, generator=g) * 0.05}


def test_a_model_that_trains_slowly_stays_healthy_and_its_level_follows_it() -> None:
    params = _model()
    guard = ParamGuard()
    assert guard.reset(params) == ""
    start = guard.level
    assert guard.norm == math.sqrt(float(params[0].norm()) ** 2 + float(params[1].norm()) ** 2)
    for _ in range(300):  # the norm grows by 1% per update: 20x in 300 updates, never 10x in one time constant
        params[0] = params[0] * 1.01
        assert guard.updated(0, params) == ""
    assert guard.level > 5 * start, "the running level follows honest growth"


def test_a_non_finite_parameter_is_named_with_its_chunk() -> None:
    params = _model()
    guard = ParamGuard()
    guard.reset(params)
    params[1] = params[1].clone()
    params[1][7] = math.nan
    problem = guard.updated(1, params)
    assert "not finite" in problem and "[1]" in problem, problem
    params[1][7] = math.inf
    assert "not finite" in guard.updated(1, params)
    params[1] = torch.full((500,), 1e30)  # finite values whose norm overflows float32
    assert "overflows" in guard.updated(1, params)


def test_a_jump_far_above_the_running_level_is_a_blow_up_and_healthy_again_once_it_is_gone() -> None:
    params = _model()
    guard = ParamGuard()
    guard.reset(params)
    level = guard.level
    good = params[0]
    params[0] = good * 2 * EXPLODE_FACTOR
    problem = guard.updated(0, params)
    assert "running level" in problem and guard.level == level, "a sick model does not move the level"
    params[0] = good
    assert guard.updated(0, params) == ""


def test_a_restored_model_is_judged_afresh() -> None:
    guard = ParamGuard()
    broken = _model()
    broken[0] = broken[0].clone()
    broken[0][0] = math.nan
    assert "not finite" in guard.reset(broken)
    assert guard.reset(_model(1)) == "" and guard.problem == ""


def test_a_model_that_starts_at_zero_may_grow_to_the_floor() -> None:
    params = {0: torch.zeros(10_000)}
    guard = ParamGuard()
    assert guard.reset(params) == ""
    params[0] = torch.full((10_000,), FLOOR_RMS * EXPLODE_FACTOR * 0.9)
    assert guard.updated(0, params) == ""
    params[0] = torch.full((10_000,), FLOOR_RMS * EXPLODE_FACTOR * 100)
    assert "running level" in guard.updated(0, params)
