"""Workers behind slow links among fast ones: what each worker trains under the job's batch allocation.

Every process runs on a host of its own (network namespaces on one bridge, tests/netns.py),
started with the README's commands (tests/hosted_job.py): the scheduler and the shard on
`server` (1 Gbit), `--fast` workers behind `--fast-rate` links and `--slow` workers behind
`--slow-rate` links, the CNN on Fashion-MNIST by default. Once every worker trains, the
benchmark watches a window of `--window-s` seconds and reports, for the job and for each
worker: samples/s, its share of the samples, its batch (mean of one reading a second, and
the last), its measured compute-only speed, and its steps/s. Each policy runs in turn on
the same hosts (`--policies dynamic fixed`), so their figures share the machine's noise.

Needs root (network namespaces). Run from the repository root:

    python -m bench.links [--fast 2] [--slow 1] [--model cnn] [--protocol asgd] [--policies dynamic fixed] \
        [--window-s 40] [--out bench/results/links.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dynabatch.cluster.metric_text import metric_sum
from tests.hosted_job import HostedJob
from tests.netns import Network, unavailable

START_TIMEOUT_S = 180.0  # every worker training, on a loaded machine


@dataclass
class WorkerFigures:
    """One worker over the window."""

    host: str
    rate: str
    samples_per_s: float
    share: float
    mean_batch: float
    last_batch: float
    standalone_sps: float
    steps_per_s: float


def _standalone(log: str) -> float:
    """The compute-only speed the worker measured at its start (its log says it)."""
    found = re.findall(r"standalone speed (\d+) samples/s", log)
    return float(found[-1]) if found else 0.0


def run_policy(policy: str, args: argparse.Namespace, logs: Path) -> dict:
    """One job under `policy`; its figures over the window."""
    with Network() as net:
        server = net.add_host("server")
        workers = [net.add_host(f"fast-{i}", args.fast_rate) for i in range(args.fast)]
        workers += [net.add_host(f"slow-{i}", args.slow_rate) for i in range(args.slow)]
        job = HostedJob(net, logs / policy)
        try:
            job.scheduler(server, "--dataset", args.dataset, "--model", args.model, "--protocol", args.protocol,
                          "--batch-policy", policy, "--epochs", "1000", "--min-workers", str(len(workers)))
            job.shard(server)
            children = {h.name: job.worker(h) for h in workers}

            def counters() -> dict[str, tuple[float, float]]:
                out = {}
                for h in workers:
                    text = job.metrics(h)
                    out[h.name] = (metric_sum(text, "dynabatch_worker_samples_total"),
                                   metric_sum(text, "dynabatch_worker_steps_total"))
                return out

            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                job.launcher.check_alive()
                try:
                    if all(steps > 0 for _, steps in counters().values()):
                        break
                except OSError:
                    pass  # a worker not serving /metrics yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not every worker trained within {START_TIMEOUT_S:.0f}s")
                time.sleep(1.0)
            start, t0 = counters(), time.monotonic()
            batches: dict[str, list[float]] = {h.name: [] for h in workers}
            while time.monotonic() - t0 < args.window_s:
                for h in workers:
                    batches[h.name].append(job.value(h, "dynabatch_worker_current_batch_size"))
                time.sleep(1.0)
            end, elapsed = counters(), time.monotonic() - t0
            job.launcher.check_alive()
        finally:
            job.stop()
    total = sum(end[h.name][0] - start[h.name][0] for h in workers)
    figures = []
    for h in workers:
        samples = end[h.name][0] - start[h.name][0]
        figures.append(WorkerFigures(
            h.name, h.rate, samples / elapsed, samples / total if total else 0.0,
            sum(batches[h.name]) / len(batches[h.name]), batches[h.name][-1],
            _standalone(children[h.name].log_text()), (end[h.name][1] - start[h.name][1]) / elapsed))
    return {"policy": policy, "window_s": elapsed, "samples_per_s": total / elapsed,
            "workers": [asdict(f) for f in figures]}


def table(results: list[dict]) -> str:
    lines = ["| policy | worker | link | samples/s | share | mean batch | last batch | steps/s "
             "| standalone samples/s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['policy']} | job | | {r['samples_per_s']:.0f} | 100% | | | | |")
        for w in r["workers"]:
            lines.append(f"| {r['policy']} | {w['host']} | {w['rate']} | {w['samples_per_s']:.0f} | "
                         f"{100 * w['share']:.1f}% | {w['mean_batch']:.0f} | {w['last_batch']:.0f} | "
                         f"{w['steps_per_s']:.1f} | {w['standalone_sps']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=int, default=2, help="workers behind --fast-rate links")
    p.add_argument("--slow", type=int, default=1, help="workers behind --slow-rate links")
    p.add_argument("--fast-rate", default="1gbit")
    p.add_argument("--slow-rate", default="100mbit")
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--protocol", default="asgd")
    p.add_argument("--policies", nargs="+", default=["dynamic", "fixed"], choices=["dynamic", "fixed"])
    p.add_argument("--window-s", type=float, default=40.0)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"bench.links: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp:
        results = [run_policy(policy, args, Path(tmp)) for policy in args.policies]
    print(table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
