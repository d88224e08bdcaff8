"""The papers' claims at their scale, in the simulator (bench/simulate.py), and its check against the real runs.

- Scale: 16 workers with a long tail (12 at 1x, 4 at 8x) and 64 with log-normal
  speeds, every configuration the papers' claims name, 5 seeds, judged by the
  rules of bench/verdicts.py at equal virtual time.
- Validation: the real bench's cluster (4 workers at 1, 1, 2, 4; the CNN; B = 192)
  simulated, to set beside the real runs of bench/RESULTS.md section 1.

The 16- and 64-worker runs train the MLP, not the CNN: a simulated sample of the
CNN costs several times the MLP's CPU, and the study's 70 runs fit in the
machine's share only with the MLP (the figures: bench/RESULTS.md section 5).
Both runs of a comparison train the same model, so what differs between
protocols is what the question is about: staleness, the batch split and waiting.

Hyperparameters at scale: lr 0.02, momentum 0, 32 samples per worker (B = 512
and 2048), the same for every protocol; the 4-worker bench's lr 0.05 with
momentum 0.5 does not train at 16 workers (the probes: bench/RESULTS.md section 5).

    python -m bench.simulate --study quick   # churn16: a slowdown, a departure, two joins; about 30 s of CPU
    python -m bench.simulate --study full --jobs 2   # the validation, then 64 + 16 workers; an hour on 2 shared cores
    python -m bench.simulate --study validation --jobs 2   # the validation alone: 10 CNN runs, 34 min on 2 shared cores
    python -m bench.simulate --study paper --jobs 2   # the 16- and 64-worker parts alone
    python -m bench.simulate_study DIR       # re-render DIR/report.md and the plots from DIR/results.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import verdicts
from bench.convergence import config_label, mark_label
from bench.parallel_runs import run_parallel
from bench.simulate import PROFILES, SimConfig, SimResult, simulate
from dynabatch.common.tasks.data import load_dataset

PAPER_CONFIGS = (
    ("asgd", "fixed"),
    ("asgd", "dynamic"),
    ("softsync", "fixed"),
    ("ssgd", "fixed"),
    ("ssgd", "dynamic"),
    ("local", "dynamic"),
    ("msd", "dynamic"),
)
SEEDS = (0, 1, 2, 3, 4)
REAL_4_WORKERS = {
    "asgd+fixed": {"staleness": "2.78 / 8.3", "sps": 4470, "0.85": "21 s", "0.88": "44 s"},
    "asgd+dynamic (DBS-SGD)": {"staleness": "2.75 / 5.0", "sps": 4397, "0.85": "20 s", "0.88": "49 s"},
}
"""The real runs' figures the validation is set beside: bench/RESULTS.md section 1 (3 seeds, 70 s each)."""
VALIDATION_CONFIGS = (("asgd", "fixed"), ("asgd", "dynamic"))


@dataclass(frozen=True)
class Part:
    """One table: a profile, its global batch, model, configurations, seeds and virtual budget."""

    name: str
    profile: str
    global_batch: int
    model: str
    configs: tuple[tuple[str, str], ...]
    seeds: tuple[int, ...]
    budget_s: float
    eval_every_s: float
    eval_size: int
    lr: float = 0.05
    momentum: float = 0.5
    slower: float = 1.0  # every node's step and transfer times, times this (the virtual clock's unit)
    dataset: str = "fashion-mnist"

    @property
    def marks(self) -> tuple[str, ...]:
        """The accuracies whose times are tabled; the first is the target time-to-target claims are judged at.

        The CNN's are the real bench's 85% and 88%. The MLP's target is 80%, below what asgd+fixed reaches by the end
        of a 64-worker run (bench/RESULTS.md section 5).
        """
        return ("0.80", "0.85") if self.model == "mlp" else ("0.85", "0.88")


VALIDATION = Part("validation4", "bench4", 192, "cnn", VALIDATION_CONFIGS, SEEDS, 70.0, 3.0, 1000)
"""As the real runs: 70 s, an evaluation every 3 s; on 1,000 test images, not 10,000, whose evaluations would
cost more CPU than the rest of a run (bench/RESULTS.md section 5)."""
STUDIES: dict[str, tuple[Part, ...]] = {
    "quick": (
        Part(
            "churn16",
            "churn16",
            512,
            "mlp",
            PAPER_CONFIGS[:2] + PAPER_CONFIGS[3:5],
            (0,),
            3.0,
            0.5,
            1000,
            lr=0.02,
            momentum=0.0,
        ),
    ),
    "paper": (
        Part(
            "tail16", "tail16", 512, "mlp", PAPER_CONFIGS, SEEDS, 150.0, 2.0, 1000, lr=0.02, momentum=0.0, slower=10.0
        ),
        Part(
            "lognormal64",
            "lognormal64",
            2048,
            "mlp",
            PAPER_CONFIGS,
            SEEDS,
            150.0,
            2.0,
            1000,
            lr=0.02,
            momentum=0.0,
            slower=10.0,
        ),
    ),
    "validation": (VALIDATION,),
}
STUDIES["full"] = STUDIES["paper"] + STUDIES["validation"]


def sim_config(part: Part, seed: int, protocol: str, policy: str) -> SimConfig:
    """The run of `part` for one configuration and seed, its node times scaled by `part.slower`."""
    workers = PROFILES[part.profile]()
    base = SimConfig(protocol, policy, workers)
    return SimConfig(
        protocol,
        policy,
        workers,
        seed=seed,
        budget_s=part.budget_s,
        global_batch=part.global_batch,
        fixed_s=base.fixed_s * part.slower,
        per_sample_s=base.per_sample_s * part.slower,
        comm_s=base.comm_s * part.slower,
        model=part.model,
        eval_every_s=part.eval_every_s,
        eval_size=part.eval_size,
        job={"lr": part.lr, "momentum": part.momentum},
        dataset=part.dataset,
    )


Run = tuple[Part, int, str, str]
"""One simulation of a study: its part, seed, protocol and policy."""

_DATA: dict[str, Any] = {}
"""The datasets this process has loaded: each process of a parallel study loads each one once."""


def _simulate(run: Run) -> tuple[Run, SimResult]:
    part, seed, protocol, policy = run
    if part.dataset not in _DATA:
        _DATA[part.dataset] = load_dataset(part.dataset)
    return run, simulate(sim_config(part, seed, protocol, policy), _DATA[part.dataset])


def run_plan(plan: list[Run], jobs: int, log: Callable[[str], None]) -> Iterator[tuple[Part, SimResult]]:
    """Every run of `plan`, in `jobs` processes (1: this one), yielded as each finishes, with a progress line;
    the costliest parts go first (plan_of) so that the last to finish is a short one."""
    for (part, _, _, _), r in run_parallel(_simulate, plan, jobs, _describe, log):
        yield part, r


def _describe(run: Run, r: SimResult) -> str:
    part, seed, protocol, policy = run
    return (
        f"{part.name} {config_label(protocol, policy)} seed {seed}: {100 * r.final_test_acc:.2f}%, "
        f"{r.samples_per_s:.0f} samples/s, staleness mean "
        f"{r.staleness_mean if r.staleness_mean is None else round(r.staleness_mean, 2)}, "
        f"{mark_label(part.marks[0])} at {r.time_to.get(part.marks[0])}"
    )


def config_rows(runs: list[dict[str, Any]], marks: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per configuration: means over seeds, medians of the times to the marks (never reached counts as never)."""
    order = list(dict.fromkeys((r["protocol"], r["policy"]) for r in runs))
    rows = []
    for protocol, policy in order:
        rs = [r for r in runs if (r["protocol"], r["policy"]) == (protocol, policy)]
        accs = [r["final_test_acc"] for r in rs]
        rows.append(
            {
                "label": config_label(protocol, policy),
                "runs": len(rs),
                "time_to": {m: verdicts.median_time_to(rs, m) for m in marks},
                "reached": {m: sum(1 for r in rs if r["time_to"].get(m) is not None) for m in marks},
                "acc": statistics.fmean(accs),
                "acc_sd": statistics.stdev(accs) if len(accs) > 1 else None,
                "loss": statistics.fmean(r["final_train_loss"] or float("nan") for r in rs),
                "sps": statistics.fmean(r["samples_per_s"] for r in rs),
                "stale_mean": statistics.fmean(r["staleness_mean"] or 0.0 for r in rs),
                "stale_p99": statistics.fmean(r["staleness_p99"] or 0 for r in rs),
                "bps": statistics.fmean(r["bytes_per_sample"] for r in rs),
            }
        )
    return rows


def table(runs: list[dict[str, Any]], marks: tuple[str, ...]) -> str:
    times = " | ".join(f"time to {mark_label(m)} (median)" for m in marks)
    out = [
        f"| configuration | runs | {times} | test acc. at budget | train loss | samples/s | staleness mean / p99 "
        "| bytes/sample |",
        "|---|---:|" + "---:|" * len(marks) + "---:|---:|---:|---:|---:|",
    ]
    for row in config_rows(runs, marks):
        t = " | ".join(
            ("–" if v == float("inf") else f"{v:.0f} s") + f" ({row['reached'][m]}/{row['runs']})"
            for m, v in row["time_to"].items()
        )
        sd = f" ± {100 * row['acc_sd']:.2f}" if row["acc_sd"] is not None else ""
        out.append(
            f"| {row['label']} | {row['runs']} | {t} | {100 * row['acc']:.2f}%{sd} | "
            f"{verdicts.loss_text(row['loss'], 3)} | {row['sps']:,.0f} | "
            f"{row['stale_mean']:.2f} / {row['stale_p99']:.1f} | {row['bps']:,.0f} |"
        )
    return "\n".join(out)


def validation_table(runs: list[dict[str, Any]]) -> str:
    """Staleness, speed and times to the marks of the simulated 4-worker bench beside the real runs'."""
    out = [
        "| configuration | staleness mean / p99: simulated | real | samples/s: simulated | real "
        "| time to 85%: simulated | real | time to 88%: simulated | real |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in config_rows(runs, ("0.85", "0.88")):
        real = REAL_4_WORKERS.get(row["label"], {})
        sim_t = {m: "–" if t == float("inf") else f"{t:.0f} s" for m, t in row["time_to"].items()}
        out.append(
            f"| {row['label']} | {row['stale_mean']:.2f} / {row['stale_p99']:.0f} | "
            f"{real.get('staleness', '–')} | {row['sps']:,.0f} | {real.get('sps', 0):,} | "
            f"{sim_t['0.85']} | {real.get('0.85', '–')} | {sim_t['0.88']} | {real.get('0.88', '–')} |"
        )
    out += ["", "Simulated staleness counts (updates 0, 1, 2, ... versions stale):", ""]
    out += [
        f"- {config_label(r['protocol'], r['policy'])}, seed {r['seed']}: {', '.join(map(str, r['staleness_counts']))}"
        for r in runs
    ]
    return "\n".join(out)


def plot(runs: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Accuracy against virtual time and against samples, one colour per configuration."""
    from bench.plots import accuracy_axis, plt, save, styled

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    for r, kw in styled(runs, alpha=0.7, linewidth=1.1):
        t, samples, acc = zip(*r["curve"], strict=True)
        ax1.plot(t, [100 * a for a in acc], **kw)
        ax2.plot(samples, [100 * a for a in acc], **kw)
    for ax, xlabel in ((ax1, "virtual seconds"), (ax2, "samples")):
        accuracy_axis(ax, xlabel, (10, 92))
    return save(fig, [ax1, ax2], title, path)


def render(parts: dict[str, tuple[Part, list[dict[str, Any]]]], img: str) -> str:
    """The markdown of every part: its table, its plot and (scale parts) the papers' claims."""
    out = []
    for name, (part, runs) in parts.items():
        n = len(PROFILES[part.profile]())
        if part.configs == VALIDATION_CONFIGS:
            out += [
                f"### {name}: the real bench's 4 workers, simulated ({part.model}, B = {part.global_batch}, "
                f"{part.budget_s:g} virtual s)",
                "",
                validation_table(runs),
                "",
            ]
            continue
        out += [
            f"### {name}: {n} workers ({part.profile}), {part.model}, B = {part.global_batch}, "
            f"{part.budget_s:g} virtual s, seeds {', '.join(map(str, part.seeds))}",
            "",
            table(runs, part.marks),
            "",
            f"![{name}]({img}/simulate_{name}.png)",
            "",
        ]
        if part.configs == PAPER_CONFIGS:
            target = part.marks[0]
            claims = [
                v
                for v in verdicts.paper_claims(runs, part.eval_every_s, target)
                + verdicts.time_to_target_claims(runs, part.eval_every_s, target)
                if v.holds is not None
            ]
            out += [
                f"Verdicts at {n} workers (rules of bench/verdicts.py; equal time is the virtual budget):",
                "",
                "| claim | measured | agrees |",
                "|---|---|---|",
            ]
            out += [f"| {v.claim} | {v.measured} | **{v.word}** |" for v in claims] + [""]
    return "\n".join(out)


def write(results: dict[str, Any], out: Path, plots: bool) -> None:
    """results.json and report.md (and the plots) from whatever runs are in, so an interrupted study still reports."""
    (out / "results.json").write_text(json.dumps(results))
    parts = {
        name: (
            Part(
                **{**v["part"], "configs": tuple(map(tuple, v["part"]["configs"])), "seeds": tuple(v["part"]["seeds"])}
            ),
            v["runs"],
        )
        for name, v in results.items()
        if v["runs"]
    }
    (out / "report.md").write_text(render(parts, "plots"))
    if plots:
        for name, (_, runs) in parts.items():
            plot(runs, f"simulated: {name}", out / f"simulate_{name}.png")


def plan_of(parts: tuple[Part, ...]) -> list[Run]:
    """Every run of `parts`, the costliest part (the CNN's, then the most workers') first, seed-major within it."""
    cost = {"cnn": 2, "mlp": 1}
    ordered = sorted(parts, key=lambda p: (-cost.get(p.model, 1), -len(PROFILES[p.profile]())))
    return [
        (part, seed, protocol, policy) for part in ordered for seed in part.seeds for protocol, policy in part.configs
    ]


def in_plan_order(part: Part, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A part's runs as its configurations and seeds are listed, whatever order they finished in."""
    index = {(s, p, b): i for i, (s, (p, b)) in enumerate((s, c) for s in part.seeds for c in part.configs)}
    return sorted(runs, key=lambda r: index[(r["seed"], r["protocol"], r["policy"])])


def run_study(mode: str, out_dir: str, jobs: int = 1) -> int:
    out = Path(out_dir) / mode
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    parts = STUDIES[mode]
    results: dict[str, Any] = {part.name: {"part": asdict(part), "runs": []} for part in parts}
    for part, r in run_plan(plan_of(parts), jobs, lambda s: print(s, flush=True)):
        runs = results[part.name]["runs"]
        runs.append(asdict(r))
        runs[:] = in_plan_order(part, runs)
        write(results, out, plots=False)
    write(results, out, plots=True)
    print(f"study {mode} done in {(time.monotonic() - started) / 60:.1f} min: {out / 'report.md'}", flush=True)
    return 0


if __name__ == "__main__":  # re-render DIR's report and plots from its results.json (an interrupted study's too)
    import sys

    folder = Path(sys.argv[1])
    write(json.loads((folder / "results.json").read_text()), folder, plots=True)
