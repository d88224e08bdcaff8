"""bench/auto_default.py's comparison holds auto to the project's rule, each method at its own tuned step size:
auto is tuned on each file as the regime study tuned the others there (its tuning seeds, the delay-step methods'
grid, `choose_lr`), and a file where every step size diverged runs no auto row. Pure functions, no simulation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.auto_default import AUTO, BEST, PREVIOUS, TUNED_IN, main, plan, plot, table, tuning_profile, tuning_table
from bench.tuned_study import STUDIES, choose_lr


def _tuning(lr: float, reached_at: float | None, loss: float = 0.5) -> dict[str, Any]:
    curve = [(0.0, 0, 0.1)] + ([(reached_at, 100, 0.8)] if reached_at is not None else [(150.0, 200, 0.7)])
    return {"method": AUTO, "lr": lr, "seed": 100, "curve": curve, "final_train_loss": loss, "final_test_acc": 0.8}


def test_auto_is_tuned_on_each_file_as_the_regime_study_tuned_the_delay_step_methods_there() -> None:
    for name in BEST:
        theirs = next(p for p in STUDIES[TUNED_IN] if p.profile == name)
        ours = tuning_profile(name)
        assert ours.methods == (AUTO,) and ours.tune_seeds == theirs.tune_seeds
        assert ours.grid(AUTO) == theirs.grid("asgd+fixed (delay step)") == (0.1, 0.2, 0.4, 0.8)
        assert ours.edge_steps == theirs.edge_steps and ours.target == theirs.target


def test_the_tuned_step_is_the_soonest_that_never_diverged_and_a_file_with_none_runs_no_auto_row() -> None:
    runs = [_tuning(0.1, 90.0), _tuning(0.2, 55.0), _tuning(0.4, 40.0, loss=math.nan), _tuning(0.8, None)]
    chosen = choose_lr(runs, "0.80")
    assert chosen == 0.2, "0.4 reached it sooner but diverged"
    table = tuning_table({"mixed_links16": runs}, {"mixed_links16": chosen})
    assert "| mixed_links16 | 0.2 | 55 | 80.0% | no | **yes** |" in table
    assert "| mixed_links16 | 0.4 | 40 | 80.0% | yes |  |" in table and "| mixed_links16 | 0.8 | – |" in table
    rows = plan([0, 1], {"mixed_links16": chosen, "cpu_gpu8": None})
    assert {(m, lr) for f, m, lr, _, _ in rows if f == "mixed_links16"} == {
        (AUTO, 0.2),
        ("asgd+fixed", PREVIOUS["mixed_links16"]),
        *BEST["mixed_links16"].items(),
    }
    assert AUTO not in {m for f, m, _, _, _ in rows if f == "cpu_gpu8"}, "every step size diverged: nothing to run"
    assert len([r for r in rows if r[:2] == ("mixed_links16", AUTO)]) == 2, "one run a report seed"


def test_times_over_k_evaluations_are_tuned_run_and_tabled_apart_from_first_evaluation_times(tmp_path: Path) -> None:
    assert tuning_profile("ps_bound64", reached_over=3).reached_over == 3
    assert {i[-1] for i in plan([0], {"cpu_gpu8": 0.4}, reached_over=3)} == {3}
    first = {"file": "cpu_gpu8", "method": AUTO, "lr": 0.4, "seed": 0, "t": 16.0, "diverged": False}
    rows = [first, {**first, "t": 19.0, "reached_over": 3}]  # a row stored before --reached-over is over one
    assert "| cpu_gpu8 | auto (protocol and policy) | 0.4 | 16 | 16 |" in table(rows)
    over3 = table(rows, reached_over=3)
    assert "time to 80% (mean of 3 evaluations) by seed" in over3
    assert "| 0.4 | 19 | 19 |" in over3 and "| 16 |" not in over3
    with pytest.raises(SystemExit) as exit_:
        main(["--reached-over", "0", "--lr-auto", "0.4", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists(), "refused before anything runs or is written"


def test_the_plot_draws_every_file_that_ran_and_leaves_out_rows_of_another_reading(tmp_path: Path) -> None:
    rows = [
        {"file": f, "method": m, "lr": lr, "seed": s, "t": t, "diverged": False, "reached_over": 3}
        for f in ("cpu_gpu8", "ps_bound64")
        for (m, lr), t in {(AUTO, 0.4): 17.0, ("asgd+fixed", PREVIOUS[f]): None, ("local+dynamic", 0.32): 16.5}.items()
        for s in (0, 1)
    ]
    path = plot(rows, tmp_path / "regimes.png", reached_over=3)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="over 1 evaluations"):  # no first-evaluation row: nothing to draw
        plot(rows, tmp_path / "none.png")
