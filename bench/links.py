"""Workers behind slow links among fast ones: what each worker trains under the job's batch allocation.

Every process runs on a host of its own (network namespaces on one bridge, tests/netns.py),
started with the README's commands (tests/hosted_job.py): the scheduler and the shard on
`server` (1 Gbit), `--fast` workers behind `--fast-rate` links and `--slow` workers behind
`--slow-rate` links, training the CNN on Fashion-MNIST by default, or a user Task
(`--task FILE.py:ATTR`, with the environment knobs its file reads after an `@`, as
bench/overlap.py takes them; e.g. `examples/resnet18_cifar10.py:task@RESNET_WIDTH=8`).

Two modes. The window (default): once every worker trains, the benchmark watches
`--window-s` seconds. The target (`--target ACC`): an evaluator on a host of its own
(behind `--fast-rate`) evaluates every `--eval-interval-s`, and the benchmark runs from
the job's first step until the scheduler reports a test accuracy of at least ACC, or
`--time-limit-s` passes; it reports the time to target beside the rest. Either way, for the
job and for each worker: samples/s, its share of the samples, its batch (mean of one reading
a second, and the last), its measured compute-only speed at its start and in the job (its
samples over the compute and data time it reported: what the compute split of asgd and
softsync divides by), and its steps/s. Each policy runs
in turn on fresh hosts (`--policies dynamic fixed`), `--runs` times, the order reversed
every other run, so that the policies share the machine's noise.

Needs root (network namespaces). Run from the repository root:

    python -m bench.links [--fast 2] [--slow 1] [--model cnn | --task FILE.py:ATTR[@KEY=VALUE,...]] \
        [--protocol asgd] [--policies dynamic fixed] [--chunk-schedules fixed scheduled] [--chunk-bytes N] \
        [--slow-worker-flags '--slowdown 1:1'] [--runs 1] \
        [--window-s 40 | --target 0.85 --time-limit-s 600] [--out bench/results/links.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.overlap import BUILTIN, Workload, parse_workload
from dynabatch.cluster.metric_text import metric_by_label, metric_sum
from dynabatch.common.config import JobConfig
from dynabatch.common.planning.optimum import Device, NoiseScale
from dynabatch.common.planning.prediction import Cluster, Node, predict
from dynabatch.common.tasks.data import NUM_CLASSES, input_shape
from dynabatch.common.tasks.models import build_model
from tests.hosted_job import HostedJob
from tests.netns import Host, Network, unavailable

START_TIMEOUT_S = 180.0  # every worker training, on a loaded machine


@dataclass
class WorkerFigures:
    """One worker over the measured span."""

    host: str
    rate: str
    samples_per_s: float
    share: float
    mean_batch: float
    last_batch: float
    standalone_sps: float
    steps_per_s: float
    compute_sps: float  # samples over the span's compute and data seconds (0: none reported)
    predicted_share: float = 0.0  # the share the predictor gives it from compute_sps and its link (0: not predicted)


@dataclass
class Watch:
    """What was read from the workers' /metrics over the measured span: counters at its two ends, the batch
    once a second, and (target mode) the first time since the job's first step at which the target was met."""

    elapsed_s: float
    start: dict[str, tuple[float, float, float]]  # by host: (samples, steps, compute and data seconds) so far
    end: dict[str, tuple[float, float, float]]
    batches: dict[str, list[float]]
    time_to_target_s: float | None = None
    accuracy: float | None = None  # the latest evaluation's, at the end of the span (target mode)
    readings: list[tuple[float, float]] = field(default_factory=list)  # (s since first step, test accuracy)


def first_reaching(readings: list[tuple[float, float]], target: float) -> float | None:
    """The first time (s) at which a reading's accuracy is at least `target`; None if none is."""
    return next((t for t, acc in readings if acc >= target), None)


def figures(
    watch: Watch, hosts: list[tuple[str, str]], standalone: dict[str, float]
) -> tuple[float, list[WorkerFigures]]:
    """The job's samples/s and each worker's figures over `watch`'s span; `hosts` are (name, link rate)."""
    trained = {name: watch.end[name][0] - watch.start[name][0] for name, _ in hosts}
    total = sum(trained.values())
    out = []
    for name, rate in hosts:
        seen = watch.batches[name]
        computing = watch.end[name][2] - watch.start[name][2]
        out.append(
            WorkerFigures(
                name,
                rate,
                trained[name] / watch.elapsed_s,
                trained[name] / total if total else 0.0,
                sum(seen) / len(seen) if seen else 0.0,
                seen[-1] if seen else 0.0,
                standalone.get(name, 0.0),
                (watch.end[name][1] - watch.start[name][1]) / watch.elapsed_s,
                trained[name] / computing if computing > 0 else 0.0,
            )
        )
    return total / watch.elapsed_s, out


RATE_UNITS = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}


def rate_mbit(rate: str) -> float:
    """A tc rate (`100mbit`, `1gbit`, `512kbit`) in Mbit/s."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if found is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit")
    return float(found[1]) * RATE_UNITS[found[2]]


def link_allows(
    workers: list[WorkerFigures], protocol: str, policy: str, model_bytes: float, chunk_bytes: int
) -> list[float]:
    """Each worker's share of the job's samples as the predictor (common/planning/prediction.py) gives it from what
    the run measured: the worker's compute speed in the job (a per-sample cost; no fixed part) and its link,
    which a step crosses twice with the model's bytes, overlapped over its chunks as the pipeline does; the
    job's B split by `policy`. What the link allows that worker, where the other workers are what they were."""
    nodes = tuple(Node(Device(0.0, 1.0 / w.compute_sps), rate_mbit(w.rate)) for w in workers)
    chunks = max(1, round(model_bytes / chunk_bytes))
    plan = predict(
        Cluster(nodes, JobConfig().global_batch, model_bytes, chunks), NoiseScale(1.0, 1.0), protocol, policy
    )
    rates = [b / s if s > 0 else 0.0 for b, s in zip(plan.batches, plan.step_s, strict=True)]
    return [r / sum(rates) for r in rates]


def _standalone(log: str) -> float:
    """The compute-only speed the worker measured at its start (its log says it)."""
    found = re.findall(r"standalone speed (\d+) samples/s", log)
    return float(found[-1]) if found else 0.0


def _wait(job: HostedJob, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `ready` once a second (a process not serving /metrics yet reads as not ready) while the job lives."""
    deadline = time.monotonic() + timeout_s
    while True:
        job.launcher.check_alive()
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        time.sleep(1.0)


def _watch(job: HostedJob, server: Host, workers: list[Host], args: argparse.Namespace) -> Watch:
    """Read the job until the window ends (window mode) or the target is met or the time limit passes."""

    def counters() -> dict[str, tuple[float, float, float]]:
        out = {}
        for h in workers:
            text = job.metrics(h)
            out[h.name] = (
                metric_sum(text, "dynabatch_worker_samples_total"),
                metric_sum(text, "dynabatch_worker_steps_total"),
                sum(
                    metric_sum(text, "dynabatch_worker_phase_seconds_sum", phase=phase) for phase in ("compute", "data")
                ),
            )
        return out

    if args.target is None:
        _wait(
            job,
            lambda: all(steps > 0 for _, steps, _ in counters().values()),
            START_TIMEOUT_S,
            "not every worker trained",
        )
    else:  # from the job's first step: the min-workers gate makes it every worker's first step, within a second
        _wait(job, lambda: any(steps > 0 for _, steps, _ in counters().values()), START_TIMEOUT_S, "no worker trained")
    start, t0 = counters(), time.monotonic()
    batches: dict[str, list[float]] = {h.name: [] for h in workers}
    readings: list[tuple[float, float]] = []
    span_s = args.window_s if args.target is None else args.time_limit_s
    while time.monotonic() - t0 < span_s:
        for h in workers:
            batches[h.name].append(job.value(h, "dynabatch_worker_current_batch_size"))
        if args.target is not None:
            readings.append((time.monotonic() - t0, job.value(server, "dynabatch_job_test_accuracy")))
            if first_reaching(readings, args.target) is not None:
                break
        time.sleep(1.0)
    end, elapsed = counters(), time.monotonic() - t0
    job.launcher.check_alive()
    if args.target is None:
        return Watch(elapsed, start, end, batches)
    return Watch(elapsed, start, end, batches, first_reaching(readings, args.target), readings[-1][1], readings)


def run_policy(
    policy: str, args: argparse.Namespace, workload: Workload, logs: Path, chunks: str = "fixed"
) -> dict[str, Any]:
    """One job under batch `policy` and `--chunk-schedule chunks` on fresh hosts; its figures over the window,
    or from its start to the target."""
    model = ["--dataset", args.dataset, "--model", args.model] if not workload.task else []
    task = ["--task", workload.task] if workload.task else []
    with Network() as net:
        server = net.add_host("server")
        workers = [net.add_host(f"fast-{i}", args.fast_rate) for i in range(args.fast)]
        workers += [net.add_host(f"slow-{i}", args.slow_rate) for i in range(args.slow)]
        evaluator = net.add_host("eval", args.fast_rate) if args.target is not None else None
        job = HostedJob(net, logs / policy)
        try:
            job.scheduler(
                server,
                *model,
                "--protocol",
                args.protocol,
                "--batch-policy",
                policy,
                "--epochs",
                "1000",
                "--chunk-schedule",
                chunks,
                "--chunk-bytes",
                str(args.chunk_bytes),
                *args.job_flags.split(),
                "--min-workers",
                str(len(workers)),
                "--eval-interval-s",
                str(args.eval_interval_s),
            )
            job.shard(server)
            slow = args.slow_worker_flags.split()
            children = {h.name: job.worker(h, *task, *(slow if h.name.startswith("slow") else [])) for h in workers}
            if evaluator is not None:
                job.worker(evaluator, *task, evaluator=True)
            watch = _watch(job, server, workers, args)
            chosen = metric_by_label(job.metrics(server), "dynabatch_scheduler_auto_batch_policy", "policy")
        finally:
            job.stop()
    standalone = {name: _standalone(child.log_text()) for name, child in children.items()}
    samples_per_s, per_worker = figures(watch, [(h.name, h.rate) for h in workers], standalone)
    ran = policy if policy != "auto" else next((p for p, on in chosen.items() if on), "fixed")
    label = policy if policy != "auto" else f"auto ({ran})"
    label = label if chunks == "fixed" else f"{label}, {chunks} chunks"
    if not workload.task and all(w.compute_sps > 0 for w in per_worker):
        built = build_model(args.model, input_shape(args.dataset), NUM_CLASSES, 0)
        model_bytes = 4.0 * sum(p.numel() for p in built.parameters())
        allows = link_allows(per_worker, args.protocol, ran, model_bytes, args.chunk_bytes)
        for w, share in zip(per_worker, allows, strict=True):
            w.predicted_share = share
    out = {
        "policy": label,
        "span_s": watch.elapsed_s,
        "samples_per_s": samples_per_s,
        "workers": [asdict(f) for f in per_worker],
    }
    if args.target is not None:
        out |= {
            "target": args.target,
            "time_to_target_s": watch.time_to_target_s,
            "accuracy": watch.accuracy,
            "readings": watch.readings,
        }
    return out


def table(results: list[dict[str, Any]]) -> str:
    """One row for the job (with its time to target, in target mode) and one for each worker, per run."""
    lines = [
        "| run | policy | worker | link | to target (s) | samples/s | share | mean batch | last batch | steps/s "
        "| standalone samples/s | compute samples/s | predicted share |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if "target" in r:
            reached = r["time_to_target_s"]
            to_target = (
                f"{reached:.0f}"
                if reached is not None
                else f"not in {r['span_s']:.0f} (reached {100 * r['accuracy']:.1f}%)"
            )
        else:
            to_target = ""
        rows = [[r["run"], r["policy"], "job", "", to_target, f"{r['samples_per_s']:.0f}", "100%", *[""] * 6]]
        rows += [
            [
                r["run"],
                r["policy"],
                w["host"],
                w["rate"],
                "",
                f"{w['samples_per_s']:.0f}",
                f"{100 * w['share']:.1f}%",
                f"{w['mean_batch']:.0f}",
                f"{w['last_batch']:.0f}",
                f"{w['steps_per_s']:.2f}",
                f"{w['standalone_sps']:.0f}",
                f"{w['compute_sps']:.0f}",
                f"{100 * w['predicted_share']:.1f}%" if w.get("predicted_share") else "",
            ]
            for w in r["workers"]
        ]
        lines += [" ".join(f"| {cell}" if cell != "" else "|" for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def schedule(policies: list[str], runs: int) -> list[tuple[int, str]]:
    """(run, policy) in the order run: each run has every policy, the order reversed every other run (ABBA),
    so that a load drifting over the benchmark favours none."""
    return [
        (run, policy) for run in range(1, runs + 1) for policy in (policies if run % 2 else list(reversed(policies)))
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=int, default=2, help="workers behind --fast-rate links")
    p.add_argument("--slow", type=int, default=1, help="workers behind --slow-rate links")
    p.add_argument("--fast-rate", default="1gbit")
    p.add_argument("--slow-rate", default="100mbit")
    trains = p.add_mutually_exclusive_group()
    trains.add_argument("--model", default="cnn", help="a built-in model, on --dataset")
    trains.add_argument(
        "--task",
        default="",
        metavar="FILE.py:ATTR[@KEY=VALUE,...]",
        help="a user Task instead of --model, with the environment its file reads",
    )
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--protocol", default="asgd")
    p.add_argument("--policies", nargs="+", default=["dynamic", "fixed"], choices=["auto", "dynamic", "fixed"])
    p.add_argument(
        "--chunk-schedules",
        nargs="+",
        default=["fixed"],
        choices=["fixed", "scheduled"],
        help="every policy under each --chunk-schedule (the wire's schedule: scheduler/wire_schedule.py)",
    )
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="the job's --chunk-bytes")
    p.add_argument(
        "--job-flags",
        default="",
        metavar="'--FLAG VALUE ...'",
        help="more of the scheduler's job flags, e.g. '--no-direction-check'",
    )
    p.add_argument(
        "--slow-worker-flags",
        default="",
        metavar="'--FLAG VALUE ...'",
        help="more flags for the --slow hosts' workers, e.g. '--slowdown 1:1' (a second of compute more per step)",
    )
    p.add_argument("--runs", type=int, default=1, help="every policy this many times, the order reversed each run")
    p.add_argument("--window-s", type=float, default=40.0, help="window mode: seconds watched once every worker trains")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="ACC",
        help="target mode: run from the first step until the test accuracy is at least ACC (0-1)",
    )
    p.add_argument("--time-limit-s", type=float, default=600.0, help="target mode: give up after this long")
    p.add_argument("--eval-interval-s", type=float, default=5.0, help="seconds between evaluations")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = p.parse_args(argv)
    try:
        workload = parse_workload(args.task) if args.task else Workload(BUILTIN)
    except ValueError as exc:
        p.error(str(exc))
    if args.target is not None and not 0.0 < args.target <= 1.0:
        p.error(f"--target {args.target}: an accuracy, above 0 and at most 1")
    if args.runs < 1:
        p.error(f"--runs {args.runs}: at least 1")
    reason = unavailable()
    if reason is not None:
        print(f"bench.links: {reason}", file=sys.stderr)
        return 2
    os.environ.update(workload.env)  # the task file's knobs: every process the job starts inherits them
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp:
        configs = [f"{policy}:{chunks}" for policy in args.policies for chunks in args.chunk_schedules]
        for run, config in schedule(configs, args.runs):
            policy, chunks = config.split(":")
            logs = Path(tmp) / f"run{run}-{chunks}"
            results.append({"run": run} | run_policy(policy, args, workload, logs, chunks))
            print(table(results[-1:]).split("\n", 2)[2], file=sys.stderr, flush=True)
    print(table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
