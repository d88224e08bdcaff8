"""bench/auto_unseen.py's verdict on each drawn cluster (auto against the best method it may choose, within 1.2x or
not, any divergence, whether auto chose or ran its start to the end) from the rows its runs write, and the names
and budgets of a fresh draw's clusters: pure functions, no simulation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.auto_default import AUTO
from bench.auto_unseen import (
    UNMEASURED,
    _item,
    _profile,
    _time_to,
    also_table,
    cluster_name,
    main,
    plan,
    split_table,
    split_verdicts,
    table,
    verdicts,
)
from bench.drawn_clusters import DRAW_SEED
from dynabatch.scheduler.auto_policy import HELD


def _row(cluster: str, method: str, t: float | None, choices: list[Any] | None = None) -> dict[str, Any]:
    return {
        "cluster": cluster,
        "method": method,
        "t": t,
        "diverged": False,
        "switched_to": "",
        "choices": choices or [],
    }


def test_auto_is_judged_against_the_fastest_method_of_its_cluster() -> None:
    chose = [(-1.0, "ssgd + dynamic: predicted fastest to target")]
    waited = [(-1.0, f"asgd + fixed: fixed {UNMEASURED} 8 steps (9 of 10 measured)")]
    rows = [
        _row("a", AUTO, 11.0, chose) | {"switched_to": "ssgd"},
        _row("a", "asgd+fixed", 12.0),
        _row("a", "ringmaster+fixed", 10.0),
        _row("b", AUTO, None, waited),
        _row("b", "asgd+fixed", 30.0) | {"diverged": True},
        _row("b", "local+dynamic", None),
        _row("c", AUTO, None),
        _row("c", "asgd+fixed", None),
        _row("d", AUTO, 20.0, [(-1.0, f"asgd + fixed: kept{HELD} every worker has reported 8 steps (9 of 10)")]),
        _row("d", "asgd+fixed", 20.0),
    ]
    a, b, c, d = verdicts(rows)
    assert d["chose"], "a choice held while a new worker is measured is still a choice"
    assert (a["best"], a["best_t"], a["ratio"], a["within"], a["chose"]) == ("ringmaster+fixed", 10.0, 1.1, True, True)
    assert a["switched_to"] == "ssgd" and a["prev_default"] == 12.0
    assert b["best"] == "asgd+fixed" and math.isinf(b["ratio"]) and not b["within"] and not b["chose"]
    assert b["switched_to"] == "asgd" and b["diverged"] == ["asgd+fixed"]
    assert c["within"], "where no method reached the target, auto not reaching it is no miss"
    assert "within 1.2x of the best on 3 of 4 clusters" in table(rows)


def test_with_several_seeds_each_method_is_judged_by_its_median() -> None:
    seeds: list[tuple[str, list[float | None]]] = [
        (AUTO, [25.0, 23.0, 26.0]),  # alone, seed 0 is 1.32x of the other's seed 0
        ("DBS-SGD (capped weight)", [19.0, 29.0, 24.0]),
        ("ringmaster+fixed", [None, None, 10.0]),  # never in two seeds of three: no median
        ("asgd+fixed", [40.0, 30.0, 41.0]),
    ]
    rows = [_row("e", m, t) | {"seed": s} for m, ts in seeds for s, t in enumerate(ts)]
    rows[0] |= {"switched_to": "local"}  # what auto ran is its first seed's
    rows[-1] |= {"diverged": True}
    rows[-2] |= {"diverged": True}
    (e,) = verdicts(rows[::-1])
    assert (e["auto"], e["best"], e["best_t"], e["within"]) == (25.0, "DBS-SGD (capped weight)", 24.0, True)
    assert e["switched_to"] == "local" and e["prev_default"] == 40.0 and e["diverged"] == ["asgd+fixed"]
    fewer = [r for r in rows if r["method"] != "asgd+fixed"]  # --methods without the previous default
    (f,) = verdicts(fewer)
    assert f["best"] == "DBS-SGD (capped weight)" and math.isinf(f["prev_default"]) and "| – s |" in table(fewer)


def test_a_split_picks_the_best_on_the_first_seeds_and_judges_it_and_auto_on_the_others() -> None:
    seeds: list[tuple[str, str, list[float | None]]] = [
        ("g", "ringmaster+fixed", [10.0, 9.0, 11.0, 14.0, 13.0, 12.0]),  # best on 0-2 (10), itself 1.3x on 3-5
        ("g", "asgd+fixed", [12.0, 12.0, 12.0, 11.0, 11.0, 11.0]),  # best on 3-5, not where the best is picked
        ("g", AUTO, [20.0, 20.0, 20.0, 11.0, 12.0, 11.5]),  # 1.15x of 10 on 3-5, though 2x on 0-2
        ("h", "local+dynamic", [30.0, None, 30.0, None, None, 33.0]),  # never in most of 3-5
        ("h", AUTO, [30.0, 30.0, 30.0, 30.0, 36.0, 33.0]),
        ("i", "asgd+fixed", [None] * 6),  # nobody reaches the target
        ("i", AUTO, [None] * 6),
    ]
    rows = [_row(c, m, t) | {"seed": s} for c, m, ts in seeds for s, t in enumerate(ts)]
    g, h, i = split_verdicts(rows, {0, 1, 2})
    assert (g["best"], g["best_t"], g["itself"], g["auto"]) == ("ringmaster+fixed", 10.0, 1.3, 1.15)
    assert not g["itself_within"] and g["auto_within"], "the best picked on 0-2, not the faster one on 3-5"
    assert h["best"] == "local+dynamic" and math.isinf(h["itself"]) and h["auto"] == 1.1 and h["auto_within"]
    assert i["itself_within"] and i["auto_within"], "where nothing reaches the target, neither is a miss"
    assert "the best method itself on 1 of 3 clusters, auto on 3" in split_table(rows, {0, 1, 2})
    assert [v["cluster"] for v in split_verdicts(rows, {3, 4, 5})] == ["g", "h", "i"]
    assert split_verdicts([r for r in rows if r["method"] != AUTO], {0, 1, 2}) == [], "no auto: nothing to judge"


def test_a_method_run_also_is_measured_against_the_verdict_without_moving_it() -> None:
    rm = "ringmaster+fixed (delay step)"
    rows = [
        _row("j", AUTO, 15.0),
        _row("j", "asgd+fixed", 10.0),
        _row("j", rm, 9.0),  # faster than the best, yet not the verdict's best: auto cannot choose it
        _row("k", AUTO, None),
        _row("k", "asgd+fixed", 20.0),
        _row("k", rm, None),
    ]
    out = also_table(rows, {rm: 0.4})
    assert "| j | asgd+fixed (10 s) | 15 s | 9 s, 0.90x, 0.60x |" in out, out
    assert "| k | asgd+fixed (20 s) | never | never |" in out, out
    assert f"{rm} within 1.2x of the best on 1 of 2 clusters" in out
    assert [v["best"] for v in verdicts([r for r in rows if r["method"] != rm])] == ["asgd+fixed"] * 2


def test_also_refuses_what_is_not_a_study_method_at_a_step_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in (
        "nonsense=0.4",
        "ringmaster+fixed (delay step)=fast",
        "ringmaster+fixed (delay step)=-1",
        "asgd+fixed=0.1",
        f"{AUTO}=0.4",
    ):
        with pytest.raises(SystemExit) as e:
            main(["--also", bad, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--also {bad!r}: give METHOD=LR" in err
        assert "ringmaster+fixed (delay step)" in err and AUTO not in err.split("not already run")[1], err
    assert not (tmp_path / "out").exists(), "a bad flag runs nothing and writes nothing"


def test_runs_of_a_time_over_several_evaluations_are_kept_apart_from_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items = plan(7, 2, [0, 1], 0.4, reached_over=3)
    assert items and all(i[-1] == 3 for i in items) and len(set(items)) == len(items)
    old = {"draw_seed": 7, "i": 0, "method": AUTO, "lr": 0.4, "seed": 0}  # stored before --reached-over
    assert _item(old) == (7, 0, AUTO, 0.4, 0, 1) and _item(old | {"reached_over": 3}) in items
    assert _profile(7, 0, 3).reached_over == 3 and _profile(7, 0).reached_over == 1
    assert _time_to([old | {"reached_over": 3}]) == "time to 80% (mean of 3 evaluations)"
    assert _time_to([old]) == "time to 80%"
    with pytest.raises(SystemExit) as e:
        main(["--reached-over", "0", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--reached-over: 0: give at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_fresh_draw_is_named_for_its_seed_and_the_studys_own_keeps_its_names() -> None:
    assert cluster_name(DRAW_SEED, 3) == "drawn3" and cluster_name(7, 3) == "fresh7-3"
    profile = _profile(7, 0)
    assert profile.profile == "fresh7-0" and profile.budget_s > 0 and profile.eval_every_s == profile.budget_s / 60
