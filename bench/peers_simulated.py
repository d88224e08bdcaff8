"""What the other machines buy: dynabatch's default against DDP, the fastest machine alone and the m fastest, simulated.

Two cores cannot run 16, 64 or 256 real workers; bench/simulate.py runs them in virtual
time with the real scheduler and shard code (its public entry point `simulate` only).
What can be expressed there is compared, each at its own tuned step size:

- dynabatch's default: the protocol and batch policy common/config.py gives a job without flags (`auto`
  and `auto`: it starts on asgd with fixed batches and switches to what it predicts fastest);
- asgd with fixed batches (`--protocol asgd`, the default before `--protocol auto`), with a constant step and with
  `--staleness-step delay` (each gradient's step divided by its staleness), the flag a user of many asynchronous
  nodes would reach for;
- dynabatch with ringmaster and fixed batches, the best measured on tail16 after the push fix
  (bench/RESULTS.md 14b): dynabatch's best here is the faster of the two;
- DDP: bulk synchronous with equal batches (ssgd + fixed) on every node, global batch B;
- the fastest machine alone, at a node's share B/n (one worker: plain SGD);
- the m fastest synchronous (m = n/4), equal batches of B/n: a user who leaves the slow machines out.

hivemind is not expressible (its matchmaking and averaging are not a protocol of the
shards). Step sizes are tuned on every profile, each peer over its own grid, as
bench/tuned_study.py tunes them (tuning seeds 100, 101, its `choose_lr` and `diverged`;
tuning runs stop at the target); where an edge of the grid wins, the grid goes on past it
(bench/peers.py's `beyond_edge`, at most EXTEND_AT_MOST more).

    python -m bench.peers_simulated                          # tail16, lognormal64, lognormal256
    python -m bench.peers_simulated --profiles tail16 --seeds 0 --tune-seeds 100 --jobs 2
    python -m bench.peers_simulated --profiles lognormal64 --lr lognormal64:ddp=0.4 --peers dynabatch ddp

Every finished simulation is appended to OUT/runs.jsonl and not run again: an interrupted
comparison goes on where it stopped (a run is a function of its settings and seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.parallel_runs import run_parallel
from bench.peers import EXTEND_AT_MOST, beyond_edge
from bench.simulate import PROFILES, SimConfig, SimResult, WorkerSpec, simulate
from bench.tuned_study import ROUND_LRS, STEP_LRS, choose_lr, diverged, median_time, time_to
from dynabatch.common.config import AUTO_PROTOCOL, JobConfig
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.tasks.data import load_dataset

SLOWER = 10.0  # every node's step and transfer times, times this (as bench/tuned_study.py's profiles)
BUDGET_S = 150.0
TARGET = "0.80"


@dataclass(frozen=True)
class Peer:
    """One way to use the cluster: a protocol and batch policy on some of its nodes, at some global batch."""

    key: str
    label: str
    protocol: str
    policy: str
    share: int  # how many nodes it uses: 0 all, 1 the fastest, -4 the fastest quarter
    lrs: tuple[float, ...]
    settings: tuple[tuple[str, Any], ...] = ()  # job settings beyond the protocol's defaults


DEFAULT_JOB = JobConfig()  # the job a user runs without flags


def default_lrs(protocol: str) -> tuple[float, ...]:
    """The step-size grid of the default `protocol`: under `auto` the asynchronous protocols take the delay step
    (common/planning/protocol_switch.py), whose tuned step sizes are the round protocols' (bench/RESULTS.md 20)."""
    return ROUND_LRS if protocol == AUTO_PROTOCOL else STEP_LRS


PEERS: dict[str, Peer] = {
    p.key: p
    for p in (
        Peer(
            "dynabatch",
            f"dynabatch default ({DEFAULT_JOB.protocol}, {DEFAULT_JOB.batch_policy})",
            DEFAULT_JOB.protocol,
            DEFAULT_JOB.batch_policy,
            0,
            default_lrs(DEFAULT_JOB.protocol),
        ),
        # Each gradient's step divided by its staleness: larger step sizes, as DBS-SGD's delay step is tuned.
        Peer(
            "delay",
            "dynabatch asgd+fixed, --staleness-step delay",
            "asgd",
            "fixed",
            0,
            ROUND_LRS,
            (("staleness_step", "delay"),),
        ),
        Peer("ringmaster", "dynabatch ringmaster+fixed", "ringmaster", "fixed", 0, STEP_LRS),
        # The default before `--protocol auto` (`--protocol asgd`), the README's second row.
        Peer("asgd", "dynabatch asgd+fixed (--protocol asgd)", "asgd", "fixed", 0, STEP_LRS),
        Peer("ddp", "DDP (ssgd, equal batches)", "ssgd", "fixed", 0, ROUND_LRS),
        # One worker steps alone, without staleness: its grid reaches further up (0.04, STEP_LRS' top, won on tail16).
        Peer("alone", "fastest machine alone", "asgd", "fixed", 1, (0.01, 0.02, 0.04, 0.08, 0.16)),
        Peer("fastest-quarter", "n/4 fastest, synchronous", "ssgd", "fixed", -4, ROUND_LRS),
    )
}
PROFILE_BATCH = {"tail16": 512, "lognormal64": 2048, "lognormal256": 8192}


def fastest(nodes: tuple[WorkerSpec, ...], m: int) -> tuple[WorkerSpec, ...]:
    """The `m` fastest of `nodes` (least slowdown at the start)."""
    return tuple(sorted(nodes, key=lambda w: Slowdown.parse(w.slowdown).factor(0.0))[:m])


def nodes_of(peer: Peer, profile: str) -> tuple[tuple[WorkerSpec, ...], int]:
    """The nodes `peer` uses on `profile` and its global batch (B/n per node)."""
    nodes, batch = PROFILES[profile](), PROFILE_BATCH[profile]
    used = nodes if peer.share == 0 else fastest(nodes, peer.share if peer.share > 0 else len(nodes) // -peer.share)
    return used, batch // len(nodes) * len(used)


@dataclass(frozen=True)
class SimRun:
    profile: str
    peer: str
    lr: float
    seed: int
    tuning: bool


def config(run: SimRun) -> SimConfig:
    """The simulator's configuration of `run` (times scaled by SLOWER, no momentum, as the tuned study; a tuning
    run ends at the target)."""
    peer, base = PEERS[run.peer], SimConfig("asgd", "fixed", ())
    nodes, batch = nodes_of(peer, run.profile)
    return SimConfig(
        peer.protocol,
        peer.policy,
        nodes,
        seed=run.seed,
        budget_s=BUDGET_S,
        global_batch=batch,
        fixed_s=base.fixed_s * SLOWER,
        per_sample_s=base.per_sample_s * SLOWER,
        comm_s=base.comm_s * SLOWER,
        eval_every_s=2.0,
        eval_size=1000,
        job={"lr": run.lr, "momentum": 0.0, **dict(peer.settings)},
        stop_at=float(TARGET) if run.tuning else 0.0,
    )


_DATA: dict[str, Any] = {}


class Done:
    """Finished simulations, kept in a JSON-lines file (one per line: the run and its figures), so that a
    comparison interrupted part-way does not run them again. A run is known by its simulator configuration: runs
    of equal configurations (a reported run of a tuning run's step size and seed) are simulated once."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.runs: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    self.runs[self._key(SimRun(**item["run"]))] = item["result"]

    @staticmethod
    def _key(run: SimRun) -> str:
        return json.dumps(asdict(config(run)), sort_keys=True, default=str)

    def run(self, plan: list[SimRun], jobs: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
        """Every run of `plan`'s figures (with its peer and step size), simulating those not done yet."""
        todo = list({self._key(r): r for r in plan if self._key(r) not in self.runs}.values())
        if len(todo) < len(plan):
            log(f"[peers simulated] {len(plan) - len(todo)} of {len(plan)} runs done already or the same as another")
        for run, r in run_parallel(_simulate, todo, jobs, _describe, log):
            result = {**asdict(r), "lr": run.lr}
            self.runs[self._key(run)] = result
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps({"run": asdict(run), "result": result}) + "\n")
        return [{**self.runs[self._key(r)], "peer": r.peer} for r in plan]


def _simulate(run: SimRun) -> tuple[SimRun, SimResult]:
    if "data" not in _DATA:
        _DATA["data"] = load_dataset("fashion-mnist")
    return run, simulate(config(run), _DATA["data"])


def _describe(run: SimRun, r: SimResult) -> str:
    return (
        f"{run.profile}{' tuning' if run.tuning else ''} {run.peer} lr {run.lr:g} seed {run.seed}: "
        f"{100 * r.final_test_acc:.2f}%, {r.samples_per_s:.0f} samples/s, {TARGET} at "
        f"{time_to(asdict(r), TARGET):g} s"
    )


def study(
    profiles: Sequence[str],
    seeds: Sequence[int],
    tune_seeds: Sequence[int],
    jobs: int,
    log: Callable[[str], None],
    given: dict[str, dict[str, float]] | None = None,
    done: Done | None = None,
    peers: Sequence[str] = tuple(PEERS),
) -> dict[str, Any]:
    """Tune each of `peers` on each profile (except the step sizes `given` by profile and peer), then run the report
    seeds; every run's figures (those in `done` are not run again)."""
    given = given or {}
    done = done or Done(None)
    chosen: dict[str, dict[str, float | None]] = {}
    tuning: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, list[dict[str, Any]]] = {}
    for profile in profiles:
        mine = dict(given.get(profile, {}))
        grids = {k: list(PEERS[k].lrs) for k in peers if k not in mine}
        tuned: list[dict[str, Any]] = []
        for _ in range(EXTEND_AT_MOST + 1):
            plan = [SimRun(profile, k, lr, s, True) for k, lrs in grids.items() for lr in lrs for s in tune_seeds]
            tuned = done.run(plan, jobs, log)
            more = {
                k: beyond_edge(lrs, choose_lr([d for d in tuned if d["peer"] == k], TARGET)) for k, lrs in grids.items()
            }
            if not any(more.values()):
                break
            for k, lr in more.items():
                if lr is not None and len(grids[k]) < len(PEERS[k].lrs) + EXTEND_AT_MOST:
                    grids[k].append(lr)
        tuning[profile] = tuned
        chosen[profile] = {
            k: mine[k] if k in mine else choose_lr([d for d in tuned if d["peer"] == k], TARGET) for k in peers
        }
        log(f"[peers simulated] {profile}: step sizes {chosen[profile]}")
        plan = [
            SimRun(profile, k, lr, s, False)
            for k, lr in chosen[profile].items()
            if lr is not None and k in peers
            for s in seeds
        ]
        report[profile] = done.run(plan, jobs, log)
    return {
        "profiles": list(profiles),
        "seeds": list(seeds),
        "tune_seeds": list(tune_seeds),
        "target": TARGET,
        "budget_s": BUDGET_S,
        "chosen": chosen,
        "given": given,
        "tuning": tuning,
        "report": report,
    }


def rows(results: dict[str, Any], profile: str) -> list[dict[str, Any]]:
    """One row per peer on `profile`: nodes, batch, step size, median time to the target, accuracy, samples/s."""
    out = []
    for key, peer in PEERS.items():
        runs = [r for r in results["report"].get(profile, []) if r["peer"] == key]
        if not runs:
            continue
        nodes, batch = nodes_of(peer, profile)
        t = median_time(runs, results["target"])
        out.append(
            {
                "peer": key,
                "label": peer.label,
                "nodes": len(nodes),
                "global_batch": batch,
                "lr": runs[0]["lr"],
                "time_to_target": None if t == float("inf") else t,
                "reached": sum(time_to(r, results["target"]) != float("inf") for r in runs),
                "runs": len(runs),
                "diverged": sum(diverged(r) for r in runs),
                "acc": statistics.fmean(r["final_test_acc"] for r in runs),
                "samples_per_s": statistics.fmean(r["samples_per_s"] for r in runs),
                "staleness": _mean_of(r.get("staleness_mean") for r in runs),
            }
        )
    return out


def _mean_of(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def tuning_line(results: dict[str, Any], profile: str) -> str:
    """Every step size tried on `profile` per peer: its median time to the target over the tuning seeds."""
    items = []
    for key in PEERS:
        runs = [r for r in results["tuning"].get(profile, []) if r["peer"] == key]
        if not runs:
            continue
        lrs = sorted({r["lr"] for r in runs})
        tried = []
        for lr in lrs:
            mine = [r for r in runs if r["lr"] == lr]
            t = median_time(mine, results["target"])
            what = "diverged" if any(diverged(r) for r in mine) else "–" if t == float("inf") else f"{t:.0f} s"
            star = "**" if lr == results["chosen"][profile].get(key) else ""
            tried.append(f"{star}{lr:g}{star} {what}")
        items.append(f"{key} " + ", ".join(tried))
    return f"Tuning ({profile}, median time to {float(results['target']):.0%}): " + "; ".join(items) + "."


def render(results: dict[str, Any]) -> str:
    """One table per profile, and the step sizes its tuning tried."""
    parts = []
    for profile in results["profiles"]:
        given = results.get("given", {}).get(profile, {})
        given_text = ", ".join(f"{k} {v:g}" for k, v in given.items())
        tuned = (
            f"step sizes given: {given_text}"
            if not results["tuning"].get(profile)
            else f"step sizes tuned on seeds {', '.join(map(str, results['tune_seeds']))}"
            + (f", except {given_text} (given)" if given else "")
        )
        parts += [
            f"#### {profile}: MLP, B = {PROFILE_BATCH[profile]}, {results['budget_s']:.0f} virtual s, "
            f"seeds {', '.join(map(str, results['seeds']))}; {tuned}",
            "",
            f"| peer | nodes | global batch | lr | time to {float(results['target']):.0%} (median) | "
            "reached | diverged | test acc. at budget | samples/s | staleness (mean) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows(results, profile):
            t = "–" if row["time_to_target"] is None else f"{row['time_to_target']:.0f} s"
            parts.append(
                f"| {row['label']} | {row['nodes']} | {row['global_batch']} | {row['lr']:g} | {t} | "
                f"{row['reached']}/{row['runs']} | {row['diverged']}/{row['runs']} | "
                f"{100 * row['acc']:.2f}% | {row['samples_per_s']:,.0f} | "
                + ("–" if row["staleness"] is None else f"{row['staleness']:.1f}")
                + " |"
            )
        parts.append("")
        if results["tuning"].get(profile):
            parts += [tuning_line(results, profile), ""]
    return "\n".join(parts)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers_simulated", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--profiles", nargs="+", choices=list(PROFILE_BATCH), default=list(PROFILE_BATCH))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--tune-seeds", nargs="+", type=int, default=[100, 101])
    p.add_argument("--jobs", type=int, default=1, help="simulations side by side")
    p.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS), help="compare only these")
    p.add_argument("--out", type=Path, default=Path("bench/results/peers_simulated"))
    p.add_argument(
        "--lr",
        nargs="+",
        default=[],
        metavar="PROFILE:PEER=LR",
        help="run PEER on PROFILE at LR instead of tuning it there (the profile's other peers are tuned)",
    )
    args = p.parse_args(argv)
    given: dict[str, dict[str, float]] = {}
    try:
        for item in args.lr:
            where, lr = item.split("=", 1)
            profile, peer = where.split(":", 1)
            if profile not in PROFILE_BATCH or peer not in PEERS:
                raise ValueError(item)
            given.setdefault(profile, {})[peer] = float(lr)
    except ValueError:
        p.error(
            f"--lr: expected PROFILE:PEER=LR with a profile of {', '.join(PROFILE_BATCH)} and a peer of "
            f"{', '.join(PEERS)}, got {args.lr}"
        )

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    done = Done(args.out / "runs.jsonl")
    results = study(args.profiles, args.seeds, args.tune_seeds, args.jobs, log, given, done, args.peers)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "report.md").write_text(render(results))
    log(f"report: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
