"""dynabatch's benchmarks in one command: convergence, a mid-run slowdown, transport, DDP, scale, and the peers
(DDP, hivemind, the fastest machine alone) each tuned.

    python -m bench --quick      # under 10 minutes on 2 cores
    python -m bench              # the full run behind bench/RESULTS.md (about 3.5 hours, 2 of them the peers)
    python -m bench --publish    # ...and write bench/RESULTS.md and bench/plots/ from it

Results go to DIR (default bench/results/MODE): results.json (everything
measured), report.md and the PNG plots. Progress lines go to stderr.
Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import zmq

from bench import convergence, ddp, peers, plots, report, scale, transport
from bench.convergence import Settings as ConvergenceSettings
from bench.transport import Case
from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.common.tasks.data import load_dataset
from dynabatch.common.tasks.dataset_files import DatasetNotFound

PARTS = ("heterogeneous", "midrun", "transport", "ddp", "scale", "peers")
PUBLISHED = Path("bench/RESULTS.md")
PUBLISHED_PLOTS = Path("bench/plots")
M = 1_000_000
MIB = 1 << 20


@dataclass(frozen=True)
class Mode:
    """Everything a mode measures."""

    name: str
    convergence: ConvergenceSettings
    midrun: ConvergenceSettings
    transport_cases: tuple[Case, ...]
    transport: transport.Settings
    ddp: ddp.Settings
    scale: scale.Settings
    peers: peers.Settings


QUICK = Mode(
    "quick",
    convergence.Settings((("ssgd", "fixed"), ("asgd", "fixed"), ("asgd", "dynamic"), ("msd", "dynamic")), (0,), 30.0),
    convergence.Settings((("asgd", "fixed"), ("asgd", "dynamic")), (0,), 30.0),
    (Case(M // 10), Case(M), Case(10 * M), Case(M, MIB // 4), Case(M, 4 * MIB), Case(10 * M, shards=2)),
    transport.QUICK,
    ddp.Settings(workers=2, duration_s=12.0, rounds=1),
    scale.Settings(workers=(8, 16), shards=(1, 2), window_s=3.0),
    peers.QUICK,
)
FULL = Mode(
    "full",
    convergence.Settings(convergence.all_configs(), (0, 1, 2), 70.0),
    convergence.Settings(convergence.all_configs(), (0,), 70.0),
    tuple(
        [Case(n) for n in (M // 10, M, 5 * M, 10 * M, 25 * M)]
        + [Case(n, c) for n in (M, 10 * M) for c in (MIB // 4, 4 * MIB)]
        + [Case(10 * M, shards=s) for s in (2, 3, 4)]
    ),
    transport.Settings(rounds=4, block_bytes=300_000_000, warmup=2),
    ddp.Settings(workers=2, duration_s=25.0, rounds=2),
    scale.Settings(workers=(8, 16, 32), shards=(1, 2, 4), window_s=8.0),
    peers.FULL,
)


def with_configs(mode: Mode, configs: tuple[tuple[str, str], ...]) -> Mode:
    """`mode` measuring only `configs` in the heterogeneous scenario, with its seeds and budget.

    This is how a configuration added later (a new protocol) is measured beside a few
    reference ones in one run, without the hour the whole benchmark takes.
    """
    return replace(mode, convergence=replace(mode.convergence, configs=configs))


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_parts(mode: Mode, parts: list[str], out: Path, data_dir: str) -> dict[str, Any]:
    """Measure the chosen parts in a fixed order; each part's figures land in the results as it finishes."""
    results: dict[str, Any] = {}
    for scenario in ("heterogeneous", "midrun"):
        if scenario in parts:
            settings = mode.convergence if scenario == "heterogeneous" else mode.midrun
            progress(
                f"== {scenario}: {len(settings.configs)} configurations x {len(settings.seeds)} seed(s), "
                f"{settings.budget_s:.0f} s each"
            )
            runs = convergence.run_scenario(scenario, settings, out / "runs", data_dir, progress)
            results[scenario] = {
                "runs": [asdict(r) for r in runs],
                "configs": [c.to_dict() for c in convergence.aggregate(runs)],
            }
    with tempfile.TemporaryDirectory(prefix="dynabatch-bench-") as tmp:
        if "transport" in parts:
            progress(f"== transport: {len(mode.transport_cases)} cases")
            torch.set_num_threads(transport.CLIENT_THREADS)
            rows = transport.compare(
                zmq.Context.instance(), Path(tmp), "flat", list(mode.transport_cases), mode.transport
            )
            results["transport"] = [{**asdict(r), "ratio": r.ratio} for r in rows]
        if "ddp" in parts:
            progress(f"== ddp: {mode.ddp.workers} workers, {mode.ddp.rounds} round(s)")
            rounds = ddp.compare(mode.ddp, out / "ddp", data_dir, progress)
            results["ddp"] = ddp.summary(mode.ddp, rounds)
        if "scale" in parts:
            progress(f"== scale: {mode.scale.workers} workers x {mode.scale.shards} shards")
            results["scale"] = scale.to_json(scale.run_all(mode.scale, Path(tmp), progress))
    if "peers" in parts:
        progress(
            f"== peers: {', '.join(mode.peers.systems)}, {mode.peers.rounds} round(s) of "
            f"{mode.peers.budget_s:.0f} s after tuning"
        )
        results["peers"] = peers.compare(mode.peers, out / "peers", data_dir, progress)
    return results


def draw(results: dict[str, Any], out: Path) -> None:
    """Every plot the report links to, from the results alone."""
    titles = {
        "heterogeneous": "4 workers at slowdowns 1, 1, 2, 4 (every run)",
        "midrun": "worker 0 at 1x, then 4x from a third of the budget, then 1x again",
    }
    for scenario, title in titles.items():
        if scenario in results:
            plots.curves(results[scenario]["runs"], title, out / f"{scenario}.png")
    if "midrun" in results:
        shown = [r for r in results["midrun"]["runs"] if r["protocol"] == "asgd" and r["batches"]][:2]
        if shown:
            plots.batches(shown, "batch sizes when worker 0 slows down mid-run", out / "midrun_batches.png")
    if results.get("transport"):
        plots.transport(results["transport"], out / "transport.png")
    if results.get("scale"):
        plots.scale(results["scale"], out / "scale.png")
    if results.get("peers"):
        peers.plot(results["peers"], out / "peers.png")


def write(results: dict[str, Any], out: Path, publish: bool) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    draw(results, out)
    (out / "report.md").write_text(report.render(results, ""))
    progress(f"report: {out / 'report.md'}")
    if publish:
        PUBLISHED_PLOTS.mkdir(parents=True, exist_ok=True)
        for png in out.glob("*.png"):
            shutil.copy(png, PUBLISHED_PLOTS / png.name)
        fresh = report.render(results, "plots/")
        PUBLISHED.write_text(report.carry_over(PUBLISHED.read_text(), fresh) if PUBLISHED.exists() else fresh)
        progress(f"published: {PUBLISHED} and {PUBLISHED_PLOTS}/")


def parse_args(argv: list[str]) -> argparse.Namespace:
    summary, details = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m bench",
        description=summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    p.add_argument("--quick", action="store_true", help="the short mode (under 10 minutes on 2 cores)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default: all)")
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="PROTOCOL+POLICY",
        help="measure only these heterogeneous configurations, e.g. ssp+fixed asgd+dynamic "
        "(default: the mode's; the mode's seeds and budget are kept)",
    )
    p.add_argument("--out", type=Path, help="results folder (default: bench/results/MODE)")
    p.add_argument("--data-dir", default="", help="folder with Fashion-MNIST (default: the standard places)")
    p.add_argument("--publish", action="store_true", help=f"also write {PUBLISHED} and {PUBLISHED_PLOTS}/")
    p.add_argument(
        "--target-metric",
        default="",
        metavar="METRIC>=VALUE",
        help="also time every convergence run to this target (e.g. loss<=0.4), next to 85%% and 88%%",
    )
    p.add_argument(
        "--report-only",
        type=Path,
        metavar="DIR",
        help="re-render DIR/report.md and the plots from DIR/results.json without measuring",
    )
    args = p.parse_args(argv)
    if args.configs is not None:
        if args.report_only or args.publish or "heterogeneous" not in args.parts:
            p.error(
                "--configs measures some of the heterogeneous configurations: it needs the heterogeneous part "
                f"and goes with neither --report-only nor --publish (which would rewrite all of {PUBLISHED})"
            )
        try:
            args.configs = convergence.parse_configs(args.configs)
        except ValueError as exc:
            p.error(f"--configs: {exc}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.report_only:
        results = json.loads((args.report_only / "results.json").read_text())
        write(results, args.report_only, args.publish)
        return 0
    mode = QUICK if args.quick else FULL
    if args.target_metric:
        try:
            target = str(MetricTarget.parse(args.target_metric))
        except ValueError as exc:
            progress(f"python -m bench: --target-metric: {exc}")
            return 2
        mode = replace(
            mode, convergence=replace(mode.convergence, target=target), midrun=replace(mode.midrun, target=target)
        )
    if not Path("bench/__main__.py").exists():
        progress("run from the repository root: python -m bench")
        return 2
    if {"heterogeneous", "midrun", "ddp", "peers"} & set(args.parts):
        try:
            load_dataset("fashion-mnist", args.data_dir or None)
        except DatasetNotFound as exc:
            progress(f"python -m bench: {exc}")
            return 2
    signal.signal(signal.SIGTERM, lambda signum, _f: sys.exit(128 + signum))
    if args.configs:
        mode = with_configs(mode, args.configs)
    out = args.out or Path("bench/results") / mode.name
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.monotonic()
    measured = run_parts(mode, args.parts, out, args.data_dir)
    results = {
        "mode": mode.name,
        "command": shlex.join(["python", "-m", "bench", *argv]),
        "started": started,
        "wall_s": time.monotonic() - t0,
        "machine": transport.machine(),
        "settings": {"convergence": asdict(mode.convergence), "midrun": asdict(mode.midrun)},
        **measured,
    }
    write(results, out, args.publish)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
