"""The tuned study's choices (bench/tuned_study.py): a step size that diverged is never chosen, nor is a method
that diverged the default; the rest is decided by time to the target."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench.simulate import PROFILES
from bench.tuned_study import (
    CLUSTERS,
    DEFAULT,
    STUDIES,
    TUNED_AUTO,
    TUNED_LRS,
    Profile,
    Results,
    Run,
    _done,
    choose_default,
    choose_lr,
    cost_line,
    diverged,
    grown,
    lr_source,
    median_time,
    method_rows,
    past_edge,
    reference_s,
    render,
    sim_config,
    unseen_lognormal,
)


def _run(
    method: str, lr: float, reached_at: float | None, loss: float | None = 0.5, acc: float = 0.85
) -> dict[str, Any]:
    curve = [(0.0, 0, 0.1)] + ([(reached_at, 100, 0.81)] if reached_at is not None else []) + [(150.0, 200, acc)]
    return {
        "method": method,
        "lr": lr,
        "seed": 0,
        "curve": curve,
        "final_train_loss": loss,
        "final_test_acc": acc,
        "samples_per_s": 1.0,
        "staleness_mean": 1.0,
    }


def test_a_run_diverged_when_its_loss_is_not_finite_or_huge_or_its_model_is_at_chance_or_a_worker_quarantined() -> None:
    assert not diverged(_run("m", 0.1, 30.0))
    assert diverged(_run("m", 0.1, None, loss=None))
    assert diverged(_run("m", 0.1, None, loss=1e30))
    assert diverged(_run("m", 0.1, 30.0, acc=0.11))
    assert diverged({**_run("m", 0.1, 30.0), "quarantined": 1}), "an honest worker quarantined: it was blowing up"
    untouched = {**_run("m", 0.1, None, loss=2.3, acc=0.05), "curve": [(0.0, 0, 0.05), (30.0, 700, 0.05)]}
    assert not diverged(untouched), "no update reached the model (a round never closed): it did not blow up"
    assert not diverged({**untouched, "final_train_loss": None})
    assert diverged({**untouched, "final_train_loss": math.inf}), "a worker's own loss blew up"


def test_the_step_size_chosen_never_diverged_and_reaches_the_target_soonest() -> None:
    runs = [
        _run("m", 0.04, 10.0),
        _run("m", 0.04, None, loss=math.nan),  # fastest, but one seed blew up
        _run("m", 0.02, 30.0),
        _run("m", 0.02, 40.0),
        _run("m", 0.01, 60.0),
        _run("m", 0.01, 50.0),
    ]
    assert choose_lr(runs, "0.80") == 0.02
    assert median_time(runs[2:4], "0.80") == 35.0
    assert choose_lr([_run("m", 0.04, None, loss=math.nan)], "0.80") is None
    ties = [_run("m", 0.02, None, acc=0.7), _run("m", 0.01, None, acc=0.75)]
    assert choose_lr(ties, "0.80") == 0.01  # neither gets there: the more accurate


def test_the_default_is_the_fastest_method_that_never_diverged_on_any_profile() -> None:
    profiles = {name: {"methods": ["safe", "fast", "slow"], "target": "0.80", "lr_from": ""} for name in ("a", "b")}
    report = {
        "a": [_run("safe", 0.02, 30.0), _run("fast", 0.04, 10.0), _run("slow", 0.01, 90.0)],
        "b": [_run("safe", 0.02, 40.0), _run("fast", 0.04, None, loss=math.inf), _run("slow", 0.01, 80.0)],
    }
    chosen: dict[str, dict[str, float | None]] = {name: {"safe": 0.02, "fast": 0.04, "slow": 0.01} for name in profiles}
    assert choose_default(Results(report=report, chosen=chosen, profiles=profiles)) == "safe"
    report["a"] = [r for r in report["a"] if r["method"] != "safe"]  # not run everywhere: not a candidate
    assert choose_default(Results(report=report, chosen=chosen, profiles=profiles)) == "slow"
    never = {
        "a": [_run("first", 0.02, None, acc=0.7), _run("accurate", 0.02, None, acc=0.78)],
        "b": [_run("first", 0.02, 30.0), _run("accurate", 0.02, 40.0)],
    }
    tied = {name: {"methods": ["first", "accurate"], "target": "0.80", "lr_from": ""} for name in never}
    assert choose_default(Results(report=never, profiles=tied)) == "accurate", "both medians never: the more accurate"
    three = {name: {"methods": ["quick", "everywhere"], "target": "0.80", "lr_from": ""} for name in "abc"}
    quick = {"a": _run("quick", 0.02, 10.0), "b": _run("quick", 0.02, 10.0), "c": _run("quick", 0.02, None, acc=0.7)}
    runs = {name: [quick[name], _run("everywhere", 0.02, 20.0)] for name in three}
    assert choose_default(Results(report=runs, profiles=three)) == "everywhere", "the faster median never gets to c"


def test_a_resumed_study_skips_exactly_the_runs_it_holds_and_the_report_says_which_were_not_run() -> None:
    profile = Profile("bench4", 128, ("asgd+fixed", "later", "unstable"), (0, 1))
    held = {**_run("asgd+fixed", 0.01, 30.0), "seed": 0}
    res = Results(
        report={"bench4": [held]},
        profiles={"bench4": asdict(profile)},
        chosen={"bench4": {"asgd+fixed": 0.01, "later": 0.02, "unstable": None}},
    )
    assert _done(res, Run(profile, "asgd+fixed", 0.01, 0, tuning=False))
    assert not _done(res, Run(profile, "asgd+fixed", 0.01, 1, tuning=False))
    assert not _done(res, Run(profile, "asgd+fixed", 0.01, 0, tuning=True))  # a tuning run is another run
    assert not _done(res, Run(profile, "asgd+fixed", 0.02, 0, tuning=False))
    report = render(res)
    assert "| asgd+fixed | 0.01 | 30 s | 1/1 | 0/1 |" in report, report
    t_star = reference_s(asdict(profile))  # the MLP on Fashion-MNIST to 80%: the setting K(B) was measured for
    assert t_star and f"T* = {t_star:.1f} s" in report and f"| 1.00x | {30.0 / t_star:.2f}x | 30 |" in report, report
    assert reference_s({**asdict(profile), "dataset": "synthetic"}) is None
    assert "| later | – | not run (lr 0.02) |" in report and "| unstable | – | every step size diverged" in report
    resumed = render(Results(report={"bench4": [held]}, profiles={"bench4": asdict(profile)}))
    assert "| asgd+fixed | 0.01 | 30 s | 1/1 |" in resumed, "not tuned again yet: its runs' lr"


def test_a_study_table_of_a_cluster_file_gives_each_methods_time_against_the_best_and_t_star() -> None:
    """T* from the file's own figures (each group's curve and cap), not through the study's plumbing."""
    import json
    from pathlib import Path

    from dynabatch.common.planning.optimum import PER_WORKER_BATCHES, STUDY_NOISE, Device, calibrated_optimum

    profile = next(p for p in STUDIES["regimes"] if p.profile == "mixed_gpus16")
    groups = json.loads(Path("bench/profiles/mixed_gpus16.json").read_text())["workers"]
    devices = [Device(g["fixed_s"], g["per_sample_s"], g["max_batch"]) for g in groups for _ in range(g["count"])]
    t_star = calibrated_optimum(STUDY_NOISE, devices, PER_WORKER_BATCHES).time_s
    times = {m: 30.0 + 5 * i for i, m in enumerate(profile.methods)}
    runs = [{**_run(m, 0.01, t), "seed": 0} for m, t in times.items()]
    runs.append({**_run("local+dynamic", 0.01, None, loss=math.nan), "seed": 1})
    res = Results(
        report={"mixed_gpus16": runs},
        profiles={"mixed_gpus16": asdict(profile)},
        chosen={"mixed_gpus16": dict.fromkeys(profile.methods, 0.01)},
    )
    report = render(res)
    assert "16 workers, mlp, B = 2048" in report and f"T* = {t_star:.1f} s" in report, report
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    for m, t in times.items():
        if m != "local+dynamic":
            assert rows[m].endswith(
                f"| no | 85.00% ± 0.00 | 1 | 1.0 | {t / 30.0:.2f}x | {t / 30.0:.2f}x | {t / t_star:.2f}x | {t:g} |"
            ), rows[m]
    assert "| 1/2 | yes |" in rows["local+dynamic"], "one seed diverged: it diverged in some seed"


def test_a_run_on_a_cluster_file_has_its_workers_curves_caps_links_and_the_jobs_shards() -> None:
    profile = next(p for p in STUDIES["regimes-reduced"] if p.profile == "mixed_gpus16")
    cfg = sim_config(Run(profile, "asgd+fixed", 0.02, 0, tuning=False))
    assert (cfg.shards, cfg.shard_mbit, cfg.wire_bytes, cfg.global_batch) == (4, 25000, 102228128, 2048)
    assert {(w.fixed_s, w.per_sample_s, w.max_batch, w.link_mbit) for w in cfg.workers} == {
        (0.1185, 0.000804, 800, 25000),
        (0.1131, 0.00129, 600, 25000),
        (0.1656, 0.001667, 200, 25000),
        (0.0784, 0.004208, 200, 25000),
    }
    assert (
        profile.grid("asgd+fixed") == (0.01, 0.02, 0.04, 0.08) and profile.seeds == (0, 1, 2) and profile.budget_s == 60
    )
    assert profile.tune_seeds == (100,) and not set(profile.tune_seeds) & set(profile.seeds)


def test_the_cost_of_each_part_is_the_sum_of_its_runs_time_and_says_which_runs_were_not_timed() -> None:
    tuning = [{**_run("m", 0.01, 30.0), "cpu_s": s} for s in (60.0, 90.0, 30.0)]
    report = [{**_run("m", 0.01, 30.0), "cpu_s": 300.0}, _run("m", 0.01, 30.0)]
    line = cost_line(tuning, report)
    assert line.startswith("Cost (CPU minutes): 3 tuning runs, 3 min; 2 report runs, 5 min (1 runs from before"), line
    assert cost_line([], report[1:]) == "Cost (CPU minutes): 1 report runs, not timed."


def test_every_study_profile_exists_and_the_untuned_ones_take_a_tuned_profiles_step_sizes() -> None:
    for profiles in STUDIES.values():
        names = {p.profile for p in profiles}
        for p in profiles:
            assert p.profile in CLUSTERS
            # tuned in the same study, or recorded from an earlier one for every method the profile runs
            assert not p.lr_from or p.lr_from in names or set(p.methods) <= set(TUNED_LRS[p.lr_from])


def test_the_unseen_clusters_are_log_normal_of_every_size_and_none_is_a_tuned_profile() -> None:
    unseen = unseen_lognormal(6, seed=0)
    assert unseen.keys() == unseen_lognormal(6, seed=0).keys() and not unseen.keys() & PROFILES.keys()
    assert sorted(len(nodes()) for nodes in unseen.values()) == [12, 12, 24, 24, 48, 48]
    for name, nodes in unseen.items():
        sigma = float(name.split("-s")[1].split("-")[0])
        speeds = [float(n.slowdown) for n in nodes()]
        assert 0.25 <= sigma <= 1.25 and min(speeds) == 1.0 and len(set(speeds)) > len(speeds) // 2, name


def test_a_profile_that_shifts_slows_each_node_four_times_for_one_spell_and_churn_adds_and_removes_nodes() -> None:
    from dynabatch.common.slowdown import Slowdown

    for node in PROFILES["shifting32"]():
        phases = Slowdown.parse(node.slowdown).phases
        assert len(phases) == 3 and phases[1][1] == 4 * phases[0][1] == 4 * phases[2][1] and phases[2][0] < 150
    nodes = PROFILES["churn32"]()
    assert sum(1 for n in nodes if n.leave_s < math.inf) == 6 and sum(1 for n in nodes if n.join_s > 0) == 6


@pytest.mark.slow
def test_the_quick_study_tunes_reports_and_names_a_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.tuned_study import run_study

    assert run_study("tuned-quick", str(tmp_path), jobs=1) == 0
    report = (tmp_path / "tuned-quick" / "report.md").read_text()
    quick = STUDIES["tuned-quick"][0]
    assert "each method's step size tuned over its grid on seeds 100" in report
    grown = (*quick.lrs, 2 * quick.lrs[-1])  # one step past a winning edge (edge_steps 1)
    assert all(any(f"| {m} | {lr:g} |" in report for lr in grown) for m in quick.methods), report
    assert (tmp_path / "tuned-quick" / "tuned_bench4.png").stat().st_size > 10_000
    assert "### mixed_gpus16: 16 workers" in report and (tmp_path / "tuned-quick" / "tuned_mixed_gpus16.png").exists()
    assert "default by measurement: " in capsys.readouterr().out
    assert "Cost (CPU minutes): 9 tuning runs, " in report and "The whole study: " in report
    chosen = {m: lr for m in quick.methods if (lr := next((lr for lr in grown if f"| {m} | {lr:g} |" in report), 0))}
    assert run_study("tuned-quick", str(tmp_path), jobs=1, resume=True, only=("default",)) == 0
    again = (tmp_path / "tuned-quick" / "report.md").read_text()
    source = chosen[lr_source(DEFAULT)]
    assert f"| {DEFAULT.name} | {source:g} | " in again, "the default at its fixed-batch method's tuned step size"
    assert all(f"| {m} | {lr:g} |" in again for m, lr in chosen.items()), "the study's rows are kept beside it"
    assert "Cost (CPU minutes): 9 tuning runs, " in again, "nothing tuned again"


def test_the_regime_study_runs_the_issues_methods_each_over_a_grid_of_at_least_four_on_seeds_apart() -> None:
    from bench.tuned_study import METHODS, REGIME_METHODS

    protocols = {(METHODS[m].protocol, METHODS[m].policy) for m in REGIME_METHODS}
    assert {("ringmaster", "fixed"), ("rennala", "dynamic"), ("msync", "fixed"), ("asgd", "efficient")} <= protocols
    assert {("asgd", "fixed"), ("asgd", "dynamic"), ("ssgd", "fixed"), ("ssgd", "dynamic")} <= protocols
    assert ("staleness_step", "delay") in METHODS["DBS-SGD (delay step)"].settings
    for p in STUDIES["regimes"]:
        assert p.seeds == (0, 1, 2, 3, 4) and not set(p.tune_seeds) & set(p.seeds)
        assert DEFAULT.name in p.methods and p.grid(DEFAULT.name) == (), "the default at its source's step size"
        auto = p.grid(TUNED_AUTO.name)
        assert auto == p.grid("asgd+fixed (delay step)"), "auto tuned too, over the grid of the step it starts on"
        for m in set(p.methods) - {DEFAULT.name}:
            grid = p.grid(m)
            assert len(grid) >= 4 and grid[-1] == 2 * METHODS[m].lrs[-1], (m, grid)


def test_a_grid_grows_past_the_edge_its_winner_sits_on_and_not_from_inside() -> None:
    grid = [0.1, 0.2, 0.4]
    assert past_edge(grid, 0.4) == 0.8 and past_edge(grid, 0.1) == 0.05
    assert past_edge(grid, 0.2) is None
    assert past_edge(grid, None) == 0.05, "every step size diverged: a smaller one"


def test_the_fine_regime_study_tunes_every_method_on_grids_a_factor_sqrt_2_apart_over_the_same_range() -> None:
    fine = STUDIES["regimes-fine"]
    assert [p.profile for p in fine] == ["mixed_links16", "mixed_gpus16"], "the contested files, the cheaper first"
    coarse = {p.profile: p for p in STUDIES["regimes"]}
    for p in fine:
        assert p.seeds == tuple(range(10)) and p.tune_seeds == (100, 101) and p.methods == coarse[p.profile].methods
        for m in p.methods:
            grid, doubling = p.grid(m), coarse[p.profile].grid(m)
            assert grid[::2] == doubling and len(grid) == max(0, 2 * len(doubling) - 1), (m, grid)
            assert all(abs(math.log2(b / a) - 0.5) < 0.05 for a, b in zip(grid, grid[1:], strict=False)), (m, grid)
        assert p.grid(TUNED_AUTO.name) == (0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8)
        assert p.grid("asgd+fixed")[4:7] == (0.02, 0.028, 0.04)
    assert grown([0.1, 0.14, 0.2], 0.4, 1) == [0.1, 0.14, 0.2, 0.28, 0.4], "grown as fine as the rest"
    assert grown([0.1, 0.14, 0.2], 0.05, 1) == [0.05, 0.071, 0.1, 0.14, 0.2]
    assert grown([0.1, 0.2], 0.4, 0) == [0.1, 0.2, 0.4], "a doubling grid grows as before"


def test_a_methods_row_counts_only_the_runs_at_its_chosen_step_size() -> None:
    """A grid extended after a first choice leaves report runs at the earlier step size in a resumed folder."""
    p = asdict(Profile("bench4", 128, ("asgd+fixed",), (0,)))
    runs = [
        _run("asgd+fixed", 0.02, 30.0),
        {**_run("asgd+fixed", 0.04, 20.0), "seed": 1},
        _run("asgd+fixed", 0.04, 24.0),
    ]
    (row,) = method_rows(p, runs, {"asgd+fixed": 0.04})
    assert (row["lr"], row["runs"], row["time"]) == (0.04, 2, 22.0)
    assert row["by_seed"] == [24.0, 20.0], "each seed's time, in seed order whatever order the runs finished in"


def test_the_default_is_what_a_job_runs_with_every_flag_at_its_default_at_a_tuned_step_size() -> None:
    from bench.tuned_study import ALL, METHODS
    from dynabatch.common.config import JobConfig

    job = JobConfig()
    assert (DEFAULT.protocol, DEFAULT.policy) == (job.protocol, job.batch_policy)
    assert job.protocol in DEFAULT.name and job.batch_policy in DEFAULT.name and DEFAULT.name not in ALL
    source = METHODS[lr_source(DEFAULT)]
    assert (job.protocol, source.protocol, source.policy) == ("auto", "asgd", "fixed"), "what auto starts on"
    assert source.settings == (("staleness_step", "delay"),), "with the step auto runs every protocol under"
    assert source.lrs, "a tuned method"
    job_of_run = sim_config(Run(STUDIES["regimes"][0], DEFAULT.name, 0.02, 0, tuning=False))
    assert (job_of_run.protocol, job_of_run.policy) == (job.protocol, job.batch_policy)


def test_msync_takes_the_clusters_fastest_m_with_transfers_counted_so_a_slow_link_is_left_out() -> None:
    from bench.reference_time import cluster_optimum
    from bench.tuned_study import msync_m

    links = next(p for p in STUDIES["regimes"] if p.profile == "mixed_links16")
    m = msync_m("mixed_links16")
    assert 1 <= m <= 12, "the four workers behind 10 Mbit/s (a 72 s step) are never among the fastest"
    assert sim_config(Run(links, "msync+fixed", 0.2, 0, tuning=False)).job["sync_m"] == m
    assert "sync_m" not in sim_config(Run(links, "asgd+fixed", 0.02, 0, tuning=False)).job
    base = sim_config(Run(Profile("tail16", 512, ("msync+fixed",), (0,)), "msync+fixed", 0.2, 0, False))
    assert msync_m("tail16") == cluster_optimum(PROFILES["tail16"](), base.fixed_s, base.per_sample_s).workers


def test_the_drawn_clusters_are_mixed_unseen_and_their_caps_hold_the_global_batch() -> None:
    from bench.drawn_clusters import DRAW_SEED, draw_clusters
    from bench.tuned_study import DRAWN, FILES

    clusters = draw_clusters(12)
    assert clusters == draw_clusters(12) and clusters != draw_clusters(12, DRAW_SEED + 1)
    assert len(DRAWN) >= 10 and not DRAWN.keys() & (FILES.keys() | PROFILES.keys())
    assert DRAW_SEED not in {100, 101, 0, 1, 2, 3, 4}
    for c in clusters:
        n = sum(g.count for g in c.groups)
        assert 4 <= n <= 32 and 1 <= c.shards <= 4 and c.global_batch % n == 0 and c.model_bytes > 0
        caps = [g.device.max_batch for g in c.groups]
        assert 0 in caps or sum(g.count * g.device.max_batch for g in c.groups) >= c.global_batch
    assert len({g.link_mbit for c in clusters for g in c.groups}) >= 4, "links of every class"
    assert any(g.device.max_batch for c in clusters for g in c.groups), "some caps"
    assert len({c.shards for c in clusters}) >= 3
    for p in STUDIES["regimes-drawn"]:
        assert p.lr_from == "regimes" and not p.tune_seeds and 30 <= p.budget_s <= 300


def test_autos_pick_is_judged_against_the_best_method_and_the_best_it_could_pick() -> None:
    from bench.auto_evidence import AUTO_METHODS, auto_choice, default_choice, evidence_row, render_evidence
    from bench.tuned_study import FILES, method_rows

    file = FILES["mixed_links16"].file
    assert file is not None
    picked = AUTO_METHODS[(auto_choice(file).protocol, auto_choice(file).policy)]
    default = AUTO_METHODS[(default_choice(file).protocol, default_choice(file).policy)]
    assert default_choice(file).protocol == "asgd", "the previous default's protocol is asgd: auto picks its policy"
    assert picked != default, "a round protocol leaves the 10 Mbit workers out; the default cannot"
    times = {m: 40.0 + i for i, m in enumerate(AUTO_METHODS.values())}
    times[picked], times[default] = 44.0, 48.0
    runner = next(m for m in AUTO_METHODS.values() if m not in (picked, default))
    times[runner] = 40.0
    runs = [{**_run(m, 0.02, t), "seed": 0} for m, t in times.items()]
    runs += [{**_run("msync+fixed", 0.1, 20.0), "seed": 0}, {**_run(default, 0.02, None, math.nan, 0.5), "seed": 1}]
    p = {"methods": [*times, "msync+fixed"], "target": "0.80"}
    row = evidence_row("mixed_links16", file, method_rows(p, runs, {}))
    assert row["choice"] == picked and row["time"] == 44.0 and row["default"] == default
    assert row["best"]["method"] == "msync+fixed" and row["best_modelled"]["method"] == runner
    line = render_evidence([row])[-1]
    assert line.startswith(f"| mixed_links16 | {picked} (") and "| 2.20x |" in line and "| 1.10x |" in line, line
    assert line.endswith(f"| {default} (–) | – | 1/2 |"), "a seed diverged: never reached in the median"


def test_a_tuning_run_ends_at_its_target_and_a_report_run_runs_to_the_budget() -> None:
    from bench.simulate import simulate
    from dynabatch.common.tasks.data import load_dataset

    quick = STUDIES["tuned-quick"][0]
    data = load_dataset(quick.dataset)
    # a seed whose run reaches the target before the budget (seed 100's reaches it only at the budget's end)
    tuning = simulate(sim_config(Run(quick, "asgd+fixed", 0.05, 102, tuning=True)), data)
    report = simulate(sim_config(Run(quick, "asgd+fixed", 0.05, 102, tuning=False)), data)
    reached_at = next(t for t, _, acc in report.curve if acc >= float(quick.target))
    assert tuning.curve == [point for point in report.curve if point[0] <= reached_at], (
        "the same run, cut at its target"
    )
    assert report.curve[-1][0] == quick.budget_s > reached_at
    assert tuning.samples_per_s == tuning.samples / reached_at


def test_prediction_accuracy_sets_each_prediction_beside_the_simulated_figures() -> None:
    from bench.auto_evidence import predictor_cluster
    from bench.prediction_accuracy import Studied, accuracy, render_accuracy, render_times
    from bench.tuned_study import FILES, method_rows
    from dynabatch.common.planning.optimum import STUDY_NOISE
    from dynabatch.common.planning.prediction import predict

    file = FILES["cpu_gpu8"].file
    assert file is not None
    local = predict(predictor_cluster(file), STUDY_NOISE, "local", "dynamic")
    runs = [
        {**_run("local+dynamic", 0.3, local.time_s / 2), "seed": 0, "samples_per_s": local.samples_per_s / 4},
        {**_run("asgd+fixed", 0.02, None, acc=0.7), "seed": 0},
    ]
    rows = method_rows({"methods": ["local+dynamic", "asgd+fixed"], "target": "0.80"}, runs, {})
    studied = [Studied("cpu_gpu8", file, rows)]
    ratios = accuracy(studied)
    assert ratios["local+dynamic"]["sps"] == pytest.approx([4.0])
    assert ratios["local+dynamic"]["time"] == pytest.approx([2.0])
    assert ratios["asgd+fixed"]["time"] == [] and len(ratios["asgd+fixed"]["sps"]) == 1, "never at 80%: no time"
    assert ratios["ssgd+fixed"] == {"sps": [], "time": [], "stale": []}, "not run: nothing"
    line = render_times(studied)[-1]
    assert line.startswith("| cpu_gpu8 | ") and f"| {local.time_s:.0f} / {local.time_s / 2:.0f} |" in line
    assert "/ – |" in line and line.count("/  |") == 6, "asgd+fixed never at 80%; six methods not run"
    assert any(r.startswith("| local+dynamic | 4.00 (4.00 to 4.00, 1) | 2.00") for r in render_accuracy(studied))
