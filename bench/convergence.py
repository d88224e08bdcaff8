"""Convergence under heterogeneity: every protocol with fixed and dynamic batches at equal wall-clock time.

Each run is a real `dynabatch run` (scheduler, shard, four workers, evaluator as
separate processes) on Fashion-MNIST with the CNN, stopped by the job's
`--time-budget-s` so every run gets the same training time. Runs are ordered
seed-major (every configuration once, then every configuration again with the
next seed), so a slow patch of a shared machine hits all configurations alike
instead of one.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynabatch.cluster.launcher import command_line
from dynabatch.cluster.report import read_timeline, training_start
from dynabatch.common.wire.messages import JobStatus

PROTOCOLS = ("ssgd", "asgd", "softsync", "ssp", "local", "msd")
POLICIES = ("fixed", "dynamic")
PAPER_NAMES = {
    ("asgd", "dynamic"): "DBS-SGD",
    ("ssgd", "dynamic"): "LB-BSP",
    ("softsync", "fixed"): "n-softsync",
    ("ssp", "fixed"): "SSP",
    ("msd", "dynamic"): "multi-step delay",
}
SLOWDOWNS = ("1", "1", "2", "4")
MARKS = ("0.85", "0.88")
RUN_SLACK_S = 240.0  # start-up, the final evaluation and shutdown on a busy 2-core machine


@dataclass(frozen=True)
class Settings:
    """How much to run: the configurations, seeds and the budget each run gets."""

    configs: tuple[tuple[str, str], ...]
    seeds: tuple[int, ...]
    budget_s: float
    eval_interval_s: float = 3.0
    target: str = ""  # every run's --target-metric (e.g. "loss<=0.4"): one more time-to column after the marks
    flags: tuple[str, ...] = ()  # more `dynabatch run` flags for every run (bench/overlap.py compares variants)
    env: tuple[tuple[str, str], ...] = ()  # more environment for every run: a task file's knobs, DYNABATCH_DEVICE


def time_marks(time_tos: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The accuracy marks, then any --target-metric the runs were given: the keys of their `time_to`."""
    return MARKS + tuple(dict.fromkeys(k for time_to in time_tos for k in time_to if k not in MARKS))


def mark_label(mark: str) -> str:
    """`85%` for an accuracy mark (any fraction: the simulator's MLP is judged at 80%), the target itself
    (`loss<=0.4`) for a --target-metric."""
    try:
        return f"{float(mark):.0%}"
    except ValueError:
        return mark


def config_label(protocol: str, policy: str) -> str:
    """`asgd+dynamic (DBS-SGD)`: our name, and the paper's where there is one."""
    base = f"{protocol}+{policy}"
    paper = PAPER_NAMES.get((protocol, policy))
    return f"{base} ({paper})" if paper else base


def heterogeneous(_budget_s: float) -> tuple[str, ...]:
    """The papers' setting: two full-speed workers, one at half and one at a quarter speed."""
    return SLOWDOWNS


def midrun_slowdown(budget_s: float) -> tuple[str, ...]:
    """Worker 0 runs at 1x, then 4x from a third of the budget, then 1x again from two thirds."""
    third = budget_s / 3
    return (f"1x,4x@{third:.0f}s,1x@{2 * third:.0f}s",) + SLOWDOWNS[1:]


def mixed_devices(_budget_s: float) -> tuple[str, ...]:
    """Two accelerator-like workers (full speed and 30 ms more per step: a large fixed cost) and two CPU-like ones
    (a quarter of the speed, no fixed part): where per-worker sizing is said to pay (issue 37)."""
    return ("1:0.03", "1:0.03", "4", "4")


SCENARIOS: dict[str, Callable[[float], tuple[str, ...]]] = {
    "heterogeneous": heterogeneous,
    "midrun": midrun_slowdown,
    "mixed_devices": mixed_devices,
}


@dataclass
class RunResult:
    """One run's figures (times in seconds since the first batches were handed out)."""

    scenario: str
    protocol: str
    policy: str
    seed: int
    slowdowns: list[str]
    ok: bool
    error: str = ""
    time_to: dict[str, float | None] = field(default_factory=dict)
    final_test_acc: float | None = None
    final_train_loss: float | None = None
    samples_per_s: float | None = None
    fraction_of_standalone: float | None = None
    sum_standalone: float | None = None
    fraction_of_compute: float | None = None
    sum_compute: float | None = None
    slowest_compute: float | None = None
    staleness_mean: float | None = None
    staleness_p99: int | None = None
    bytes_per_sample: float | None = None
    train_s: float | None = None
    accuracy_curve: list[tuple[float, float]] = field(default_factory=list)
    loss_curve: list[tuple[float, float]] = field(default_factory=list)
    batches: list[list[float]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return config_label(self.protocol, self.policy)


def run_name(scenario: str, protocol: str, policy: str, seed: int) -> str:
    """The name of one run's folder (and log) under the benchmark's output folder."""
    return f"{scenario}-{protocol}-{policy}-s{seed}"


def run_one(
    scenario: str, protocol: str, policy: str, seed: int, settings: Settings, out: Path, data_dir: str
) -> RunResult:
    """One `dynabatch run`, its console output in `out/NAME.log`, its run folder in `out/NAME/`."""
    slowdowns = list(SCENARIOS[scenario](settings.budget_s))
    name = run_name(scenario, protocol, policy, seed)
    cmd = command_line(
        "run",
        [
            "--workers",
            str(len(slowdowns)),
            "--slowdowns",
            *slowdowns,
            "--protocol",
            protocol,
            "--batch-policy",
            policy,
            "--seed",
            str(seed),
            "--epochs",
            "1000",
            "--time-budget-s",
            str(settings.budget_s),
            "--eval-interval-s",
            str(settings.eval_interval_s),
            "--out",
            str(out),
            "--name",
            name,
            "--progress-s",
            "30",
            "--timeout-s",
            str(settings.budget_s + RUN_SLACK_S),
        ],
    )
    if data_dir:
        cmd += ["--data-dir", data_dir]
    if settings.target:
        cmd += ["--target-metric", settings.target]
    cmd += list(settings.flags)
    result = RunResult(scenario, protocol, policy, seed, slowdowns, ok=False)
    shutil.rmtree(out / name, ignore_errors=True)  # a run left by an earlier benchmark is replaced, never resumed
    with open(out / f"{name}.log", "wb") as log_file:
        code = subprocess.call(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **dict(settings.env)},
        )
    summary_path, timeline_path = out / name / "summary.json", out / name / "timeline.json"
    if not summary_path.exists() or not timeline_path.exists():
        result.error = f"exit {code}, no summary (see {out / name}.log)"
        return result
    summary = json.loads(summary_path.read_text())
    if "error" in summary:
        result.error = summary["error"]
        return result
    fill(result, summary, read_timeline(timeline_path))
    result.ok = code == 0 and summary["finished"]
    if not result.ok:
        result.error = f"exit {code}, finished={summary['finished']}"
    return result


def fill(result: RunResult, summary: dict[str, Any], timeline: list[JobStatus]) -> None:
    """Copy a run's summary and curves (time since training began) into `result`."""
    result.time_to = dict(summary["time_to_accuracy_s"])
    if summary.get("target_metric"):
        result.time_to[summary["target_metric"]] = summary["time_to_target_s"]
    result.final_test_acc = summary["final_test_acc"]
    result.final_train_loss = summary["final_train_loss"]
    result.samples_per_s = summary["samples_per_s"]
    result.fraction_of_standalone = summary["fraction_of_standalone"]
    result.sum_standalone = summary["sum_standalone_samples_per_s"]
    result.fraction_of_compute = summary["fraction_of_compute_speed"]
    result.sum_compute = summary["sum_compute_samples_per_s"]
    compute = [w["compute_samples_per_s"] for w in summary["workers"].values() if w["compute_samples_per_s"]]
    result.slowest_compute = min(compute) if compute else None
    result.staleness_mean = summary["staleness_mean"]
    result.staleness_p99 = summary["staleness_p99"]
    result.bytes_per_sample = summary["bytes_per_sample"]
    result.train_s = summary["train_s"]
    start = training_start(timeline) or 0.0
    # Each accuracy at the time its model existed (the evaluation arrives one evaluation later).
    evals = {
        s.eval_t if s.eval_model_t is None else s.eval_model_t: s.test_acc
        for s in timeline
        if s.test_acc is not None and s.eval_t is not None
    }
    result.accuracy_curve = [(t - start, acc) for t, acc in sorted(evals.items())]
    result.loss_curve = [(s.t - start, s.loss) for s in timeline if s.loss is not None and s.t >= start]
    result.batches = [
        [s.t - start] + [w.batch for w in sorted(s.workers.values(), key=lambda w: w.name)]
        for s in timeline
        if s.workers and s.t >= start
    ]  # worker0, worker1, ... as started


def run_scenario(
    scenario: str, settings: Settings, out: Path, data_dir: str, progress: Callable[[str], None]
) -> list[RunResult]:
    """Every configuration under every seed, seed-major; a failed run is reported, not fatal."""
    out.mkdir(parents=True, exist_ok=True)
    plan = [(seed, p, b) for seed in settings.seeds for p, b in settings.configs]
    results = []
    started = time.monotonic()
    for i, (seed, protocol, policy) in enumerate(plan, 1):
        r = run_one(scenario, protocol, policy, seed, settings, out, data_dir)
        results.append(r)
        elapsed = time.monotonic() - started
        eta = elapsed / i * (len(plan) - i)
        progress(
            f"[{scenario} {i}/{len(plan)}] {r.label} seed {seed}: "
            + (describe(r) if r.ok or r.final_test_acc else f"FAILED ({r.error})")
            + f"  (elapsed {elapsed / 60:.1f} min, about {eta / 60:.1f} min left)"
        )
    return results


def describe(r: RunResult) -> str:
    """One progress line's worth of a run."""
    acc = f"{100 * r.final_test_acc:.2f}%" if r.final_test_acc is not None else "n/a"
    times = ", ".join(
        f"{mark_label(m)} at {t:.0f}s" if t is not None else f"{mark_label(m)} not reached"
        for m, t in r.time_to.items()
    )
    return (
        f"{acc} at the budget ({times}); {r.samples_per_s or 0:.0f} samples/s = "
        f"{100 * (r.fraction_of_compute or 0):.0f}% of the compute-only speed, "
        f"{100 * (r.fraction_of_standalone or 0):.0f}% of the start-up probes"
    )


@dataclass
class ConfigStats:
    """One configuration over its seeds: means, and how many seeds reached each mark."""

    label: str
    protocol: str
    policy: str
    runs: int
    ok_runs: int
    time_to: dict[str, float | None]
    reached: dict[str, int]
    final_test_acc: float | None
    final_test_acc_sd: float | None
    final_train_loss: float | None
    samples_per_s: float | None
    fraction_of_standalone: float | None
    fraction_of_compute: float | None
    slowest_pace_fraction: float | None
    staleness_mean: float | None
    staleness_p99: float | None
    bytes_per_sample: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def _sd(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.stdev(got) if len(got) > 1 else None


def aggregate(results: list[RunResult]) -> list[ConfigStats]:
    """Per configuration, in the order first run; a mark's time is the mean over the seeds that reached it."""
    order: list[tuple[str, str]] = []
    for r in results:
        if (r.protocol, r.policy) not in order:
            order.append((r.protocol, r.policy))
    marks = time_marks(r.time_to for r in results)
    stats = []
    for protocol, policy in order:
        runs = [r for r in results if (r.protocol, r.policy) == (protocol, policy)]
        good = [r for r in runs if r.final_test_acc is not None]
        slowest = [
            len(r.slowdowns) * r.slowest_compute / r.sum_compute for r in good if r.slowest_compute and r.sum_compute
        ]
        stats.append(
            ConfigStats(
                label=config_label(protocol, policy),
                protocol=protocol,
                policy=policy,
                runs=len(runs),
                ok_runs=len(good),
                time_to={m: _mean([r.time_to.get(m) for r in good]) for m in marks},
                reached={m: sum(1 for r in good if r.time_to.get(m) is not None) for m in marks},
                final_test_acc=_mean([r.final_test_acc for r in good]),
                final_test_acc_sd=_sd([r.final_test_acc for r in good]),
                final_train_loss=_mean([r.final_train_loss for r in good]),
                samples_per_s=_mean([r.samples_per_s for r in good]),
                fraction_of_standalone=_mean([r.fraction_of_standalone for r in good]),
                fraction_of_compute=_mean([r.fraction_of_compute for r in good]),
                slowest_pace_fraction=_mean(slowest),
                staleness_mean=_mean([r.staleness_mean for r in good]),
                staleness_p99=_mean([r.staleness_p99 for r in good]),
                bytes_per_sample=_mean([r.bytes_per_sample for r in good]),
            )
        )
    return stats


def all_configs() -> tuple[tuple[str, str], ...]:
    return tuple((p, b) for p in PROTOCOLS for b in POLICIES)


def parse_configs(names: list[str]) -> tuple[tuple[str, str], ...]:
    """`ssp+fixed` and the like into (protocol, policy) pairs, in the order given, once each.

    A name that is not one of `all_configs()` raises ValueError naming every valid
    one, so a typo stops the benchmark before it spends an hour measuring.
    """
    valid = {f"{p}+{b}": (p, b) for p, b in all_configs()}
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(valid)}")
    return tuple(valid[n] for n in dict.fromkeys(names))
