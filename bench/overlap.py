"""Communication off the critical path: variants of the worker's step, side by side, with where the time goes.

Each run is a real `dynabatch run` of the heterogeneous benchmark (4 workers at
slowdowns 1, 1, 2, 4; bench/convergence.py runs it), training the CNN on
Fashion-MNIST (`cnn`) or a user Task (`FILE.py:ATTR`, with the environment knobs
its file reads after an `@`). The variants are the same job with different flags
(e.g. `--no-push-pull` against the default), run alternately within each seed so
that a shared machine's noise hits them alike: only their ratio is a claim. A
variant the job's config refuses for a protocol (`--prefetch-pull` under ssgd)
is skipped with its reason.

Besides the fraction of the workers' compute-only speed that a run keeps, it
splits the rest: for each worker, the share of its wall time spent pulling,
pushing, waiting for a round, waiting for data, and outside its steps
(heartbeats, metrics, the scheduler's answers), weighted as the fraction itself
is, by each worker's compute-only speed. Run from the repository root:

    python -m bench.overlap [--tasks cnn examples/resnet18_cifar10.py:task@RESNET_WIDTH=16] \
        [--configs asgd+dynamic] [--variants push+pull pipeline] [--budget-s 40] [--seeds 0] \
        [--device cuda] [--run-flags "--threads 3"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import plots
from bench.convergence import RunResult, Settings, parse_configs, run_name, run_one
from dynabatch.cluster.report import read_timeline, training_start
from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError, add_flags, from_args
from dynabatch.common.wire.messages import JobStatus

VARIANTS: dict[str, tuple[str, ...]] = {  # each says --pipeline, whose default (auto) depends on the model
    "pull,push": ("--no-push-pull", "--pipeline", "off"),
    "push+pull": ("--push-pull", "--pipeline", "off"),
    "pipeline": ("--pipeline", "on"),
    "prefetch": ("--prefetch-pull", "--pipeline", "off"),
    "prefetch+behind": ("--prefetch-pull", "--push-behind", "--pipeline", "off"),
}
PHASES = ("compute", "pull", "push", "wait", "data", "outside")
WARMUP_FRACTION = 0.1  # the first tenth of training (batch sizes settling) is left out of the breakdown
DEFAULT_OUT = Path("bench/results/overlap")
BUILTIN = "cnn"


@dataclass(frozen=True)
class Workload:
    """What the runs train: the benchmark's CNN on Fashion-MNIST, or a Task with the environment its file reads."""

    label: str
    task: str = ""
    env: tuple[tuple[str, str], ...] = ()

    @property
    def folder(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "-_=" else "_" for ch in self.label)


def parse_workload(spec: str) -> Workload:
    """`cnn`, or `FILE.py:ATTR` / `pkg.module:ATTR` followed by `@KEY=VALUE,KEY=VALUE` (e.g. RESNET_WIDTH=16).

    A task's knobs are environment variables because every worker loads the task
    file itself; `dynabatch run` hands its environment to the processes it starts.
    """
    if spec == BUILTIN:
        return Workload(BUILTIN)
    task, _, knobs = spec.partition("@")
    if ":" not in task:
        raise ValueError(f"{spec!r}: a workload is {BUILTIN!r} or FILE.py:ATTR[@KEY=VALUE,...]")
    env = []
    for item in filter(None, knobs.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{spec!r}: {item!r} is not KEY=VALUE")
        env.append((key, value))
    source = task.partition(":")[0]
    name = Path(source).stem if source.endswith(".py") else source
    return Workload(" ".join([name, *(f"{k}={v}" for k, v in env)]), task, tuple(env))


def refusal(variant: str, protocol: str) -> str:
    """Why the job's config refuses `variant` under `protocol` ('' when it takes it): the config's own check."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_flags(parser, JobConfig, env={})
    job = from_args(JobConfig, parser.parse_args(["--protocol", protocol, *VARIANTS[variant]]))
    try:
        job.validate()
    except ConfigError as exc:
        return str(exc)
    return ""


@dataclass
class Breakdown:
    """Shares of the workers' wall time per phase, weighted by compute-only speed; `compute` is the fraction kept."""

    compute: float = 0.0
    pull: float = 0.0
    push: float = 0.0
    wait: float = 0.0
    data: float = 0.0
    outside: float = 0.0


def breakdown(timeline: list[JobStatus]) -> Breakdown:
    """Where each worker's time went between the end of warm-up and the start of stopping.

    Totals (compute, step, data) come from the running totals of two snapshots; pull,
    push and wait, reported per step only, are their mean over the snapshots between
    times the steps taken. `outside` is wall time not inside any step.
    """
    begin = training_start(timeline) or timeline[0].t
    end = next((s for s in timeline if s.stopping), timeline[-1])
    warm = begin + WARMUP_FRACTION * (end.t - begin)
    window = [s for s in timeline if warm <= s.t <= end.t]
    shares: list[tuple[float, dict[str, float]]] = []
    for wid in sorted({w for s in window for w in s.workers}):
        seen = [s for s in window if wid in s.workers]
        if len(seen) < 2:
            continue
        a, b = seen[0].workers[wid], seen[-1].workers[wid]
        wall, steps = seen[-1].t - seen[0].t, b.observed_steps - a.observed_steps
        compute = b.compute_s_total - a.compute_s_total
        if wall <= 0 or steps <= 0 or compute <= 0:
            continue
        per_step = {
            p: statistics.mean(getattr(s.workers[wid].times, f"{p}_s") for s in seen[1:])
            for p in ("pull", "push", "wait")
        }
        phase = {
            "compute": compute,
            "data": b.data_s_total - a.data_s_total,
            **{p: v * steps for p, v in per_step.items()},
        }
        phase["outside"] = max(0.0, wall - (b.step_s_total - a.step_s_total))
        speed = (b.observed_samples - a.observed_samples) / compute
        shares.append((speed, {p: v / wall for p, v in phase.items()}))
    total = sum(speed for speed, _ in shares) or 1.0
    return Breakdown(**{p: sum(speed * share[p] for speed, share in shares) / total for p in PHASES})


@dataclass
class VariantRun:
    """One run of one variant."""

    variant: str
    run: RunResult
    breakdown: Breakdown | None
    workload: str = BUILTIN


def run_variant(
    variant: str,
    protocol: str,
    policy: str,
    seed: int,
    budget_s: float,
    out: Path,
    data_dir: str,
    workload: Workload = Workload(BUILTIN),
    device: str = "",
    run_flags: tuple[str, ...] = (),
) -> VariantRun:
    env = workload.env + ((("DYNABATCH_DEVICE", device),) if device else ())
    task = ("--task", workload.task) if workload.task else ()
    settings = Settings(
        ((protocol, policy),), (seed,), budget_s, flags=(*VARIANTS[variant], *task, *run_flags), env=env
    )
    folder = out / workload.folder / variant.replace(",", "-").replace("+", "_")
    folder.mkdir(parents=True, exist_ok=True)
    result = run_one("heterogeneous", protocol, policy, seed, settings, folder, data_dir)
    timeline = folder / run_name("heterogeneous", protocol, policy, seed) / "timeline.json"
    parts = breakdown(read_timeline(timeline)) if result.ok and timeline.exists() else None
    return VariantRun(variant, result, parts, workload.label)


def table(runs: list[VariantRun]) -> str:
    """One row per run: the fraction of compute-only speed, accuracy at the budget, and where the rest went."""
    rows = [
        "| workload | configuration | variant | seed | samples/s | of compute-only | staleness mean | test acc | "
        + " | ".join(PHASES[1:])
        + " |",
        "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * (len(PHASES) - 1),
    ]
    for v in runs:
        r, b = v.run, v.breakdown
        if not r.ok:
            rows.append(f"| {v.workload} | {r.label} | {v.variant} | {r.seed} | FAILED: {r.error} |")
            continue
        parts = " | ".join(f"{100 * getattr(b, p):.1f}%" for p in PHASES[1:]) if b else " | ".join("–" * 5)
        acc = f"{100 * r.final_test_acc:.1f}%" if r.final_test_acc is not None else "–"
        stale = f"{r.staleness_mean:.2f}" if r.staleness_mean is not None else "–"  # None: no push was acknowledged
        rows.append(
            f"| {v.workload} | {r.label} | {v.variant} | {r.seed} | {r.samples_per_s or 0:,.0f} | "
            f"{100 * (r.fraction_of_compute or 0):.1f}% | {stale} | {acc} | {parts} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=[BUILTIN], metavar="cnn|FILE.py:ATTR[@KEY=VALUE,...]")
    p.add_argument("--configs", nargs="+", default=["asgd+dynamic"], metavar="PROTOCOL+POLICY")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--budget-s", type=float, default=40.0)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--data-dir", default="")
    p.add_argument("--device", default="", help="the workers' --device (cpu, cuda, cuda:N); default: theirs")
    p.add_argument(
        "--run-flags",
        default="",
        help='more `dynabatch run` flags for every run, one string (e.g. "--threads 3 --global-batch 256")',
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    try:
        workloads = [parse_workload(spec) for spec in args.tasks]
        configs = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    runs = []
    for seed in args.seeds:
        for workload in workloads:
            for protocol, policy in configs:
                for variant in args.variants:
                    if why := refusal(variant, protocol):
                        print(f"{workload.label} {protocol}+{policy} {variant}: skipped ({why})", file=sys.stderr)
                        continue
                    v = run_variant(
                        variant,
                        protocol,
                        policy,
                        seed,
                        args.budget_s,
                        args.out,
                        args.data_dir,
                        workload,
                        args.device,
                        tuple(shlex.split(args.run_flags)),
                    )
                    print(
                        f"{workload.label} {v.run.label} {variant} seed {seed}: "
                        f"{100 * (v.run.fraction_of_compute or 0):.1f}% of compute-only",
                        file=sys.stderr,
                        flush=True,
                    )
                    runs.append(v)
    text = table(runs)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "bench.overlap", *argv])
    (args.out / "overlap.md").write_text(f"{text}\n\nCommand: `{command}`\n")
    entries = [
        {
            "workload": v.workload,
            "variant": v.variant,
            "run": asdict(v.run),
            "breakdown": asdict(v.breakdown) if v.breakdown else None,
        }
        for v in runs
    ]
    (args.out / "overlap.json").write_text(json.dumps(entries, indent=2) + "\n")
    plots.overlap(entries, args.out / "overlap.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
