"""Whether one --lr serves every protocol (bench/shared_lr.py): each method's time at a shared step size against its
own best, from the tuning runs."""

from __future__ import annotations

import math
from typing import Any

from bench.shared_lr import WITHIN, render_shared, shared_rows, times_by_lr


def _tuning(method: str, lr: float, reached_at: float | None, seed: int = 100, loss: float = 0.5) -> dict[str, Any]:
    curve = [(0.0, 0, 0.1)] + ([(reached_at, 100, 0.81)] if reached_at is not None else [(60.0, 200, 0.7)])
    acc = curve[-1][2]
    return {"method": method, "lr": lr, "seed": seed, "curve": curve, "final_train_loss": loss, "final_test_acc": acc}


def test_a_methods_time_at_a_step_size_is_the_median_over_seeds_and_a_diverged_run_never_reaches() -> None:
    runs = [
        _tuning("ssgd+fixed", 0.2, 30.0),
        _tuning("ssgd+fixed", 0.2, 40.0, seed=101),
        _tuning("ssgd+fixed", 0.4, 20.0, loss=math.inf),
        _tuning("other", 0.2, 1.0),
    ]
    assert times_by_lr(runs, "ssgd+fixed", "0.80") == {0.2: 35.0, 0.4: math.inf}


def test_one_step_size_serves_where_every_method_is_within_the_margin_of_its_own_best() -> None:
    runs = [
        *(_tuning("ssgd+fixed", lr, t) for lr, t in ((0.1, 50.0), (0.2, 30.0), (0.4, 32.0))),
        *(_tuning("asgd+fixed (delay step)", lr, t) for lr, t in ((0.1, 40.0), (0.2, 36.0), (0.4, 20.0))),
        _tuning("asgd+fixed (delay step)", 0.8, None),  # not tried by ssgd: no shared row
    ]
    rows = {r["lr"]: r for r in shared_rows(runs, "0.80")}
    assert sorted(rows) == [0.1, 0.2, 0.4]
    assert rows[0.4]["ratios"] == {"asgd+fixed (delay step)": 1.0, "ssgd+fixed": 32.0 / 30.0}
    assert rows[0.4]["worst"] <= WITHIN < rows[0.2]["worst"] == 36.0 / 20.0
    table = "\n".join(render_shared("c", runs, "0.80", {"ssgd+fixed": 0.2, "asgd+fixed (delay step)": 0.4}))
    assert "| 0.4 | 20 s (1.00x) | 32 s (1.07x) | 1.07x | yes |" in table, table
    assert "| 0.2 | 36 s (1.80x) | 30 s (1.00x) | 1.80x | no |" in table, table
    assert "tuned: asgd+fixed (delay step) 0.4, ssgd+fixed 0.2" in table


def test_a_method_that_never_reached_the_target_at_any_step_size_judges_no_step_size() -> None:
    runs = [_tuning("ssgd+fixed", 0.2, None), _tuning("msync+fixed", 0.2, 10.0), _tuning("msync+fixed", 0.4, None)]
    by_lr = {r["lr"]: r for r in shared_rows([*runs, _tuning("ssgd+fixed", 0.4, None)], "0.80")}
    assert by_lr[0.2]["worst"] == 1.0, "ssgd never reached 80%: no step size serves it, so it is left out"
    assert by_lr[0.4]["worst"] == math.inf, "msync reached it at 0.2 only"
    assert "| 0.2 | never | 10 s (1.00x) | 1.00x | yes |" in "\n".join(render_shared("c", runs, "0.80", {}))


def test_where_no_method_reached_the_target_the_table_says_so_instead_of_a_grid_of_nevers() -> None:
    runs = [_tuning("ssgd+fixed", lr, None) for lr in (0.1, 0.2)] + [_tuning("msync+fixed", 0.2, None)]
    (line, _) = render_shared("c", runs, "0.80", {"ssgd+fixed": 0.2, "msync+fixed": 0.2})
    assert "no method stepping once per B samples reached 80%" in line and "ssgd+fixed 0.2, msync+fixed 0.2" in line
