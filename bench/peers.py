"""Against what a user would run instead: dynabatch (its default, `--protocol auto`, and `--protocol asgd`, the
default before it), PyTorch DDP, hivemind and the fastest machine alone.

    python -m bench.peers                          # the full comparison (see FULL; about 3 hours on 2 cores)
    python -m bench.peers --rounds 2 --budget-s 40 --tune-seeds 1 --systems ddp alone   # a part of it
    python -m bench.peers --report-only DIR        # re-render DIR/report.md and DIR/peers.png

Every system trains the same task (the CNN on Fashion-MNIST, the job's seed, SGD with
the job's momentum and weight decay), each of four workers drawing the samples a
dynabatch worker of its index draws and slowed down 1x, 1x, 2x and 4x the same way
(common/slowdown.py's emulation: F-1 times each step's CPU time idled). Each is started
as its own docs start it (`dynabatch run`, torchrun, one hivemind peer per process with
the quickstart's settings, one plain process), and each is stopped at the same wall-clock
deadline, counted from its launch: start-up is part of every system's time.

No system evaluates anything while it trains: worker 0 (for dynabatch, the shard's
checkpoint, written every --snapshot-s) saves the model every few seconds, and one
evaluation code (`score`) scores every snapshot afterwards on the 10k test images.

Each system is run at its own step size, chosen from its grid (`System.lrs`) on tuning
seeds (100, 101, ...) apart from the reported ones (0, 1, ...), by the rule of
bench/tuned_study.py: never a step size that diverged, then the best median time to 88%,
then to 85%, then the best mean accuracy at the deadline. Where an edge of the grid wins,
the grid goes on past it (twice the largest, half the smallest; at most EXTEND_AT_MOST more).
Reported runs are interleaved (round r runs every system once, in an order rotated by r),
so a slow patch of a shared machine falls on all of them; each run records the machine's
load average while it trained. Runs already in DIR/runs.json are kept, not run again: an
interrupted comparison goes on where it stopped, and one can be measured in parts.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dynabatch.common.config import JobConfig

SLOWDOWNS = ("1", "1", "2", "4")
GLOBAL_BATCH = 192
MARKS = (0.85, 0.88)
EQUAL_TIME_S = 60.0  # accuracy at equal time: every system's model as it stood this long after launch
DIVERGED_BELOW = 0.2  # a model this far from learning at the deadline (or with a non-finite parameter) diverged
STOP_GRACE_S = 90.0  # after the deadline: a process's last snapshot, shutdown; then its group is killed
LAUNCH_SLACK_S = 300.0  # dynabatch's own --timeout-s beyond the budget
EXTEND_AT_MOST = 2  # step sizes a system's tuning adds beyond its grid's edge when an edge wins


@dataclass(frozen=True)
class System:
    """One system as a user would start it: its kind (how it is launched), its step-size grid, its own settings."""

    key: str
    label: str
    kind: str  # dynabatch, ddp, alone, hivemind
    lrs: tuple[float, ...]
    target_batch: int = 0  # hivemind: samples per collaborative step
    local_updates: bool = False  # hivemind: step locally, average in the background
    flags: tuple[str, ...] = ()  # dynabatch: flags beyond the defaults

    def unavailable(self) -> str:
        """Why this system cannot run here ("" if it can)."""
        if self.kind == "hivemind" and importlib.util.find_spec("hivemind") is None:
            return "hivemind is not installed: pip install -e '.[peers]' -c constraints-cpu.txt"
        return ""


SYSTEMS: dict[str, System] = {
    s.key: s
    for s in (
        # asgd with fixed batches, the default until --protocol auto became it (bench/RESULTS.md sections 23, 25).
        System(
            "dynabatch",
            "dynabatch asgd (fixed batches; the default before auto)",
            "dynabatch",
            (0.0125, 0.025, 0.05, 0.1),
            flags=("--protocol", "asgd"),
        ),
        # The default: the protocol chosen while the job runs; its asynchronous protocols take the delay step
        # (lr / max(1, tau)), so its step sizes are larger than the constant step's.
        System(
            "dynabatch-auto",
            "dynabatch default (--protocol auto, chosen while it runs)",
            "dynabatch",
            (0.05, 0.1, 0.2, 0.4),
            flags=("--protocol", "auto"),
        ),
        System("ddp", "PyTorch DDP (torchrun, gloo)", "ddp", (0.05, 0.1, 0.2, 0.4)),
        System("alone", "fastest machine alone", "alone", (0.025, 0.05, 0.1, 0.2)),
        # hivemind's quickstart: target batch 10000, local updates, matchmaking 3 s, averaging timeout 10 s.
        System(
            "hivemind-docs",
            "hivemind Optimizer (quickstart: target 10000, local updates)",
            "hivemind",
            (0.025, 0.05, 0.1, 0.2),
            target_batch=10000,
            local_updates=True,
        ),
        System(
            "hivemind-b",
            f"hivemind Optimizer (target B = {GLOBAL_BATCH})",
            "hivemind",
            (0.05, 0.1, 0.2, 0.4),
            target_batch=GLOBAL_BATCH,
        ),
    )
}


@dataclass(frozen=True)
class Settings:
    """How much to run."""

    systems: tuple[str, ...] = tuple(SYSTEMS)
    budget_s: float = 90.0
    rounds: int = 3
    tune_seeds: int = 2
    snapshot_s: float = 3.0
    eval_samples: int = 10_000  # the first N test images score every snapshot (a shorter run scores on fewer)
    slowdowns: tuple[str, ...] = SLOWDOWNS  # the profile (tests idle their workers with larger ones)
    lrs: tuple[tuple[str, float], ...] = ()  # step sizes given, not tuned: (system key, lr)
    tune_budgets: tuple[tuple[str, float], ...] = ()  # a system's tuning budget where not budget_s: (key, seconds)
    max_runs: int = 0  # new runs this invocation starts at most (0: no limit); the next one goes on
    lock: str = ""  # a file whose lock (flock) each run holds while it trains, shared with other wall-clock jobs

    def tuning_budget(self, key: str) -> float:
        """The budget `key`'s tuning runs get: a system that reaches the marks early in every run need not be
        tuned at the budget of one that reaches them late (time to a mark does not depend on the budget)."""
        return dict(self.tune_budgets).get(key, self.budget_s)

    def report_seeds(self) -> list[int]:
        return list(range(self.rounds))

    def tuning_seeds(self) -> list[int]:
        return [100 + i for i in range(self.tune_seeds)]


FULL = Settings()
# `make bench-quick`'s part: the machinery end to end in about 3 minutes, at step sizes given, not tuned.
QUICK = Settings(
    systems=("dynabatch", "ddp"),
    budget_s=40.0,
    rounds=1,
    tune_seeds=1,
    snapshot_s=5.0,
    eval_samples=2000,
    lrs=(("dynabatch", 0.05), ("ddp", 0.1)),
)


class Paused(Exception):
    """The invocation started its `Settings.max_runs` new runs; the runs it finished are stored."""


@dataclass
class Run:
    """One run's scored snapshots and figures; times in seconds since its launch."""

    system: str
    lr: float
    seed: int
    budget_s: float
    ok: bool = False
    error: str = ""
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (t, samples, test accuracy)
    time_to: dict[str, float | None] = field(default_factory=dict)
    samples_to: dict[str, int | None] = field(default_factory=dict)
    acc_at_budget: float | None = None
    samples_per_s: float | None = None
    diverged: bool = False
    load: float | None = None  # the machine's mean 1-minute load average while the run trained

    def acc_at(self, t: float) -> float | None:
        """The accuracy of the last snapshot taken by `t` seconds after launch (None before the first, or not
        finite)."""
        before = [acc for at, _, acc in self.curve if at <= t]
        return before[-1] if before and not math.isnan(before[-1]) else None

    @property
    def key(self) -> tuple[str, float, int, float]:
        return (self.system, self.lr, self.seed, self.budget_s)


# -- launching ----------------------------------------------------------------------------------------------------


def launch(
    system: System, lr: float, seed: int, deadline: float, settings: Settings, folder: Path, data_dir: str
) -> list[subprocess.Popen[bytes]]:
    """Start `system`'s processes (each in a process group of its own), logging into `folder`."""
    from dynabatch.cluster.launcher import command_line

    py = [sys.executable, "-m"]
    data = ["--data-dir", data_dir] if data_dir else []
    slowdowns, snapshot_s = settings.slowdowns, settings.snapshot_s

    def peer_train(slowdowns: Sequence[str]) -> list[str]:
        return [
            "bench.peer_train",
            "--system",
            system.kind,
            "--slowdowns",
            *slowdowns,
            "--batch",
            str(GLOBAL_BATCH // len(slowdowns)),
            "--lr",
            str(lr),
            "--seed",
            str(seed),
            "--deadline",
            f"{deadline:.3f}",
            "--snapshots",
            str(folder / "snapshots"),
            "--snapshot-s",
            str(snapshot_s),
            *data,
        ]

    if system.kind == "dynabatch":
        budget = deadline - time.time()
        cmds = [
            command_line(
                "run",
                [
                    "--workers",
                    str(len(slowdowns)),
                    "--slowdowns",
                    *slowdowns,
                    "--lr",
                    str(lr),
                    "--seed",
                    str(seed),
                    "--no-evaluator",
                    "--epochs",
                    "1000",
                    "--time-budget-s",
                    f"{budget:.0f}",
                    "--checkpoint-interval-s",
                    str(snapshot_s),
                    "--out",
                    str(folder),
                    "--name",
                    "run",
                    "--progress-s",
                    "30",
                    "--no-plots",
                    "--timeout-s",
                    f"{budget + LAUNCH_SLACK_S:.0f}",
                    *system.flags,
                    *data,
                ],
            )
        ]
    elif system.kind == "ddp":
        cmds = [
            [
                *py,
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(len(slowdowns)),
                "-m",
                *peer_train(slowdowns),
            ]
        ]
    elif system.kind == "alone":
        cmds = [[*py, *peer_train(slowdowns[:1])]]
    else:
        cmds = [
            [
                *py,
                *peer_train(slowdowns),
                "--rank",
                str(r),
                "--peers-file",
                str(folder / "peers.txt"),
                "--target-batch",
                str(system.target_batch),
                *(["--local-updates"] if system.local_updates else []),
            ]
            for r in range(len(slowdowns))
        ]
    procs = []
    for i, cmd in enumerate(cmds):
        with open(folder / f"process{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            )
    return procs


def watch(
    procs: list[subprocess.Popen[bytes]], deadline: float, folder: Path, checkpoint: Path | None, loads: list[float]
) -> str:
    """Wait for `procs` to end (interrupting them at the deadline where they do not stop themselves), copying
    `checkpoint` (dynabatch's shard checkpoint) into folder/checkpoints each time it is rewritten before the
    deadline, and appending the 1-minute load average to `loads` every second before it. Returns "" or what went
    wrong."""
    copies, seen, interrupted, sampled = folder / "checkpoints", 0.0, False, 0.0
    copies.mkdir(parents=True, exist_ok=True)
    while any(p.poll() is None for p in procs):
        now = time.time()
        if now < deadline and now - sampled >= 1.0:
            loads.append(os.getloadavg()[0])
            sampled = now
        if checkpoint is not None and checkpoint.exists() and now < deadline:
            mtime = checkpoint.stat().st_mtime
            if mtime != seen:
                seen = mtime
                shutil.copy(checkpoint, copies / f"{mtime:.3f}.pt")
        if now >= deadline and checkpoint is not None and not interrupted:
            for p in procs:
                p.send_signal(signal.SIGINT)  # `dynabatch run` stops its job in order, as Ctrl-C does
            interrupted = True
        if now >= deadline + STOP_GRACE_S:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            return f"killed {STOP_GRACE_S:.0f} s after the deadline"
        time.sleep(0.1)
    codes = [p.returncode for p in procs]
    return "" if all(c in (0, 130) for c in codes) else f"exit codes {codes} (see {folder}/process*.log)"


def dynabatch_snapshots(folder: Path, data_dir: str) -> None:
    """The copied shard checkpoints as snapshots like every other system's (the model's state_dict, the wall time
    the checkpoint was written, the samples the shard had applied)."""
    import io

    import torch

    from dynabatch.cluster.export import assemble, load_trained, read_run
    from dynabatch.common.tasks.builtin_tasks import builtin_task
    from dynabatch.common.verified_files import read_verified

    record = read_run(folder / "run")
    task = builtin_task(record.job.dataset, record.job.model, data_dir or None)
    snaps = folder / "snapshots"
    snaps.mkdir(exist_ok=True)
    for i, path in enumerate(sorted((folder / "checkpoints").glob("*.pt"), key=lambda p: float(p.stem))):
        state = torch.load(io.BytesIO(read_verified(path)), map_location="cpu", weights_only=True)["state"]
        model = load_trained(task, record.job.seed, assemble([state], record.job.chunk_bytes))
        torch.save(
            {"state": model.state_dict(), "t": float(path.stem), "samples": int(state["samples_seen"])},
            snaps / f"{i:04d}.pt",
        )


# -- scoring ------------------------------------------------------------------------------------------------------


class Scorer:
    """The one evaluation code: a snapshot's accuracy on the first `samples` test images, the same for every
    system."""

    def __init__(self, data_dir: str, samples: int) -> None:
        from dynabatch.common.tasks.data import load_dataset

        self.data = load_dataset("fashion-mnist", data_dir or None)
        self.samples = min(samples, len(self.data.test_y))

    def accuracy(self, state: dict[str, Any], seed: int) -> float:
        import torch

        from dynabatch.common.tasks.data import make_batch
        from dynabatch.common.tasks.models import model_for_job

        model = model_for_job(JobConfig(model="cnn", dataset="fashion-mnist", seed=seed))
        model.load_state_dict(state)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            return math.nan
        model.eval()
        n, correct = self.samples, 0
        with torch.no_grad():
            for start in range(0, n, 1000):
                x, y = make_batch(self.data, torch.arange(start, min(start + 1000, n)), False)
                correct += int((model(x).argmax(-1) == y).sum())
        return correct / n


def score(run: Run, folder: Path, launched: float, scorer: Scorer) -> None:
    """Fill `run`'s figures from its snapshots (those written by the deadline)."""
    import torch

    for path in sorted((folder / "snapshots").glob("*.pt")):
        snap = torch.load(path, map_location="cpu", weights_only=True)
        t = float(snap["t"]) - launched
        if t <= run.budget_s + 1e-6:
            run.curve.append((t, int(snap["samples"]), scorer.accuracy(snap["state"], run.seed)))
    run.curve.sort()
    for mark in MARKS:
        hit = next(((t, s) for t, s, acc in run.curve if acc >= mark), None)
        run.time_to[f"{mark:g}"] = hit[0] if hit else None
        run.samples_to[f"{mark:g}"] = hit[1] if hit else None
    if run.curve:
        last = run.curve[-1]
        run.acc_at_budget = None if math.isnan(last[2]) else last[2]
        run.diverged = math.isnan(last[2]) or last[2] < DIVERGED_BELOW
        moving = [(t, s) for t, s, _ in run.curve if s > 0]
        if len(moving) >= 2 and moving[-1][0] > moving[0][0]:
            run.samples_per_s = (moving[-1][1] - moving[0][1]) / (moving[-1][0] - moving[0][0])


@contextmanager
def wall_clock(lock: str) -> Iterator[None]:
    """While a run trains: the machine's shared lock held (where `lock` names its file; flock, as `flock LOCK cmd`
    takes it) and this process, so every process it launches, at normal priority. Scoring waits its turn outside
    the lock, at the priority the command was started with (`nice -n 10 python -m bench.peers --lock FILE`)."""
    if not lock:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            yield
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, before)
            fcntl.flock(held, fcntl.LOCK_UN)


HIVEMIND_SOCKETS = Path("/tmp")
"""Where hivemind's p2p daemons and clients put their sockets (`hivemind.p2p.P2P`'s fixed prefix, /tmp/hivemind-)."""


def stale_sockets(since: float) -> list[Path]:
    """hivemind's sockets made since `since` (time.time()) that nothing listens on: its averager's replica of a
    peer's p2p client is never shut down, so each peer left its socket files in /tmp after it ended. A socket another
    run still listens on is not stale."""
    stale = []
    for path in HIVEMIND_SOCKETS.glob("hivemind-*.sock"):
        try:
            if path.stat().st_mtime < since:
                continue
        except FileNotFoundError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                stale.append(path)
            except OSError:
                pass  # gone meanwhile, or not ours to judge
    return stale


def remove_stale_sockets(since: float) -> None:
    """Remove what hivemind's peers left behind since `since` (`stale_sockets`)."""
    for path in stale_sockets(since):
        path.unlink(missing_ok=True)


def run_one(
    system: System,
    lr: float,
    seed: int,
    settings: Settings,
    out: Path,
    data_dir: str,
    scorer: Scorer,
    budget_s: float | None = None,
) -> Run:
    """Launch, watch and score one run of `system` in out/KEY-lrLR-sSEED-BUDGET/ (budget_s: settings' if None)."""
    budget = settings.budget_s if budget_s is None else budget_s
    folder = out / f"{system.key}-lr{lr:g}-s{seed}-{budget:g}s"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    run = Run(system.key, lr, seed, budget)
    launched = time.time()
    try:
        with wall_clock(settings.lock):
            launched = time.time()
            deadline = launched + budget
            procs = launch(system, lr, seed, deadline, settings, folder, data_dir)
            checkpoint = folder / "run" / "checkpoints" / "shard-0.pt" if system.kind == "dynabatch" else None
            loads: list[float] = []
            run.error = watch(procs, deadline, folder, checkpoint, loads)
            run.load = statistics.fmean(loads) if loads else None
        if system.kind == "hivemind":
            remove_stale_sockets(launched)
        if system.kind == "dynabatch":
            dynabatch_snapshots(folder, data_dir)
        score(run, folder, launched, scorer)
    except Exception as exc:  # a run that fails is reported with its reason, not fatal to the comparison
        run.error = f"{type(exc).__name__}: {exc}"
    run.ok = not run.error and bool(run.curve)
    if not run.curve and not run.error:
        run.error = "no snapshot before the deadline"
    shutil.rmtree(folder / "snapshots", ignore_errors=True)  # scored: the figures are kept, the models are not
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return run


# -- tuning and reporting -----------------------------------------------------------------------------------------


def _median_time(runs: list[Run], mark: str) -> float:
    times = [r.time_to.get(mark) for r in runs]
    return statistics.median(math.inf if t is None else t for t in times) if times else math.inf


def choose_lr(runs: list[Run]) -> float | None:
    """The tuned step size among `runs` (one system's tuning runs): never diverged, then the best median time to
    88%, then to 85%, then the best mean accuracy at the deadline. None if every step size diverged or failed."""
    by_lr: dict[float, list[Run]] = {}
    for r in runs:
        by_lr.setdefault(r.lr, []).append(r)
    usable = {lr: rs for lr, rs in by_lr.items() if all(r.ok and not r.diverged for r in rs)}
    if not usable:
        return None
    return min(
        usable,
        key=lambda lr: (
            _median_time(usable[lr], "0.88"),
            _median_time(usable[lr], "0.85"),
            -statistics.fmean(r.acc_at_budget or 0.0 for r in usable[lr]),
        ),
    )


def beyond_edge(tried: Sequence[float], chosen: float | None) -> float | None:
    """The step size to try next when the tuned one is an edge of those `tried` (twice the largest, half the
    smallest), or None where the choice is inside the grid, nothing was usable, or that step size was tried."""
    if chosen is None or len(tried) < 2:
        return None
    more = 2 * chosen if chosen == max(tried) else chosen / 2 if chosen == min(tried) else None
    return None if more is None or more in tried else more


def aggregate(system: str, runs: list[Run]) -> dict[str, Any]:
    """One system's reported runs in one row: median times (a mark never reached counting as never), how many
    reached it, mean accuracy at the deadline, samples/s and samples to each mark."""
    ok = [r for r in runs if r.ok]
    row: dict[str, Any] = {
        "system": system,
        "label": SYSTEMS[system].label,
        "runs": len(runs),
        "ok": len(ok),
        "lr": runs[0].lr if runs else None,
        "budget_s": runs[0].budget_s if runs else None,
    }
    for mark in (f"{m:g}" for m in MARKS):
        median = _median_time(ok, mark)
        row[f"time_to_{mark}"] = None if math.isinf(median) else median
        row[f"reached_{mark}"] = sum(r.time_to.get(mark) is not None for r in ok)
        samples = [n for n in (r.samples_to.get(mark) for r in ok) if n is not None]
        row[f"samples_to_{mark}"] = statistics.median(samples) if samples else None
    accs = [r.acc_at_budget for r in ok if r.acc_at_budget is not None]
    row["acc_at_budget"] = statistics.fmean(accs) if accs else None
    row["acc_at_budget_sd"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    equal = [a for a in (r.acc_at(EQUAL_TIME_S) for r in ok) if a is not None]
    row["acc_at_equal_time"] = statistics.fmean(equal) if equal else None
    speeds = [r.samples_per_s for r in ok if r.samples_per_s]
    row["samples_per_s"] = statistics.fmean(speeds) if speeds else None
    loads = [r.load for r in runs if r.load is not None]
    row["load"] = statistics.fmean(loads) if loads else None
    return row


def load_runs(path: Path) -> dict[tuple[str, float, int, float], Run]:
    if not path.exists():
        return {}
    runs = [Run(**{**r, "curve": [tuple(p) for p in r["curve"]]}) for r in json.loads(path.read_text())]
    return {r.key: r for r in runs}


def compare(settings: Settings, out: Path, data_dir: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Tune every system on the tuning seeds, then run the reported rounds interleaved; the results."""
    out.mkdir(parents=True, exist_ok=True)
    stored = out / "runs.json"
    done = load_runs(stored)
    scorer = Scorer(data_dir, settings.eval_samples)
    skipped = {k: SYSTEMS[k].unavailable() for k in settings.systems if SYSTEMS[k].unavailable()}
    systems = [SYSTEMS[k] for k in settings.systems if k not in skipped]
    for key, why in skipped.items():
        progress(f"[peers] {key} skipped: {why}")
    given = dict(settings.lrs)
    started = 0

    def get(system: System, lr: float, seed: int, what: str, budget_s: float = settings.budget_s) -> Run:
        nonlocal started
        key = (system.key, lr, seed, budget_s)
        if key not in done:
            if settings.max_runs and started >= settings.max_runs:
                raise Paused(f"{started} new run(s) done; run the same command again to go on")
            started += 1
            t0 = time.monotonic()
            done[key] = run_one(system, lr, seed, settings, out / "runs", data_dir, scorer, budget_s)
            stored.write_text(json.dumps([asdict(r) for r in done.values()]))
            r = done[key]
            progress(
                f"[peers {what}] {system.key} lr {lr:g} seed {seed}: "
                + (
                    f"85% at {_secs(r.time_to.get('0.85'))}, 88% at {_secs(r.time_to.get('0.88'))}, "
                    f"{_pct(r.acc_at_budget)} at {budget_s:.0f} s, {_num(r.samples_per_s)} samples/s, "
                    f"load {_num1(r.load)}"
                    if r.ok
                    else f"failed: {r.error}"
                )
                + f" ({time.monotonic() - t0:.0f} s)"
            )
        return done[key]

    tuned: dict[str, float | None] = {}
    tuning: dict[str, list[dict[str, Any]]] = {}
    for system in systems:
        if system.key in given:
            tuned[system.key] = given[system.key]
            continue
        budget = settings.tuning_budget(system.key)
        runs = [get(system, lr, seed, "tune", budget) for seed in settings.tuning_seeds() for lr in system.lrs]
        tried = list(system.lrs)
        while len(tried) < len(system.lrs) + EXTEND_AT_MOST and (more := beyond_edge(tried, choose_lr(runs))):
            tried.append(more)
            runs += [get(system, more, seed, "tune (grid's edge won)", budget) for seed in settings.tuning_seeds()]
        tuned[system.key] = choose_lr(runs)
        tuning[system.key] = [aggregate(system.key, [r for r in runs if r.lr == lr]) for lr in sorted(tried)]
        progress(f"[peers tune] {system.key}: lr {tuned[system.key]}")
    reported: dict[str, list[Run]] = {s.key: [] for s in systems}
    for rnd, seed in enumerate(settings.report_seeds()):
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)] if systems else []
        for system in order:
            lr = tuned[system.key]
            if lr is not None:
                reported[system.key].append(get(system, lr, seed, f"round {rnd + 1}/{settings.rounds}"))
    rows = [aggregate(k, runs) for k, runs in reported.items() if runs]
    return {
        "settings": asdict(settings),
        "tuned_lrs": tuned,
        "tuning": tuning,
        "skipped": skipped,
        "rows": rows,
        "ratios": ratios(reported),
        "runs": [asdict(r) for rs in reported.values() for r in rs],
    }


def ratios(reported: dict[str, list[Run]]) -> dict[str, list[float | None]]:
    """Per round, each other system's time to 88% over dynabatch's (above 1: dynabatch was faster; None where
    either never reached it)."""
    ours = {r.seed: r.time_to.get("0.88") for r in reported.get("dynabatch", []) if r.ok}
    out: dict[str, list[float | None]] = {}
    for key, runs in reported.items():
        if key == "dynabatch":
            continue
        out[key] = [_ratio(r.time_to.get("0.88") if r.ok else None, ours.get(r.seed)) for r in runs]
    return out


def _ratio(theirs: float | None, ours: float | None) -> float | None:
    return theirs / ours if theirs and ours else None


# -- report -------------------------------------------------------------------------------------------------------


def _secs(t: float | None) -> str:
    return "–" if t is None else f"{t:.0f} s"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _num1(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def table(results: dict[str, Any]) -> str:
    """The reported rounds, one row per system."""
    lines = [
        "| system | lr (tuned) | runs | time to 85% | time to 88% | "
        f"test acc. at {EQUAL_TIME_S:.0f} s | test acc. at deadline | samples/s | "
        "samples to 85% | samples to 88% | load avg. |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['label']} | {row['lr']:g} | {row['ok']}/{row['runs']} | {_secs(row['time_to_0.85'])} "
            f"({row['reached_0.85']}/{row['ok']}) | {_secs(row['time_to_0.88'])} ({row['reached_0.88']}/{row['ok']}) "
            f"| {_pct(row.get('acc_at_equal_time'))} "
            f"| {_pct(row['acc_at_budget'])} ± {100 * row['acc_at_budget_sd']:.2f} | {_num(row['samples_per_s'])} "
            f"| {_num(row['samples_to_0.85'])} | {_num(row['samples_to_0.88'])} | {_num1(row.get('load'))} |"
        )
    return "\n".join(lines)


def tuning_table(results: dict[str, Any]) -> str:
    """Every step size tried per system on the tuning seeds."""
    lines = [
        "| system | lr | budget | time to 85% | time to 88% | test acc. at deadline | load avg. |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, rows in results["tuning"].items():
        for row in rows:
            chosen = " (chosen)" if row["lr"] == results["tuned_lrs"].get(key) else ""
            lines.append(
                f"| {SYSTEMS[key].label} | {row['lr']:g}{chosen} | {_secs(row.get('budget_s'))} | "
                f"{_secs(row['time_to_0.85'])} | "
                f"{_secs(row['time_to_0.88'])} | {_pct(row['acc_at_budget'])} | {_num1(row.get('load'))} |"
            )
    return "\n".join(lines)


def rounds_table(results: dict[str, Any]) -> str:
    """Every reported run, round by round, with each time to 88% over that round's dynabatch runs' (`--protocol
    asgd` and, where it ran, the default, `--protocol auto`): the ratios side by side within a round, where the
    load was alike."""
    runs = [Run(**{**r, "curve": [tuple(p) for p in r["curve"]]}) for r in results["runs"]]
    bases = [k for k in ("dynabatch", "dynabatch-auto") if any(r.system == k for r in runs)]
    lines = [
        "| round (seed) | system | time to 85% | time to 88% | "
        f"test acc. at {EQUAL_TIME_S:.0f} s | samples/s | samples to 88% | load avg. | "
        + " | ".join(f"88%: / {k}'s" for k in bases)
        + " |",
        "|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(bases),
    ]
    for seed in sorted({r.seed for r in runs}):
        in_round = [r for r in runs if r.seed == seed]
        at = {r.system: r.time_to.get("0.88") if r.ok else None for r in in_round}
        for r in in_round:
            over = [_ratio(at[r.system], at.get(k)) for k in bases]
            lines.append(
                f"| {seed + 1} ({seed}) | {SYSTEMS[r.system].label} | {_secs(r.time_to.get('0.85'))} | "
                f"{_secs(r.time_to.get('0.88'))} | {_pct(r.acc_at(EQUAL_TIME_S))} | {_num(r.samples_per_s)} | "
                f"{_num(r.samples_to.get('0.88'))} | {_num1(r.load)} | "
                + " | ".join("–" if x is None else f"{x:.2f}" for x in over)
                + " |"
            )
    return "\n".join(lines)


def load_line(runs: list[dict[str, Any]]) -> str:
    """The machine's 1-minute load average over the reported runs (each run's mean while it trained)."""
    loads = [r["load"] for r in runs if r.get("load") is not None]
    if not loads:
        return ""
    return (
        f" The machine's 1-minute load average while they trained: {min(loads):.1f} to {max(loads):.1f} "
        f"(mean {statistics.fmean(loads):.1f})."
    )


def render(results: dict[str, Any], img: str = "") -> str:
    """report.md: the settings, the table of reported rounds, the ratios, the tuning, what was skipped."""
    s = results["settings"]
    parts = [
        f"Fashion-MNIST, the CNN, {len(s['slowdowns'])} workers slowed down {', '.join(s['slowdowns'])}x, "
        "every system stopped "
        f"{s['budget_s']:.0f} s after its launch (start-up included), snapshots every {s['snapshot_s']:g} s "
        f"scored afterwards by one evaluation code on {s['eval_samples']:,} test images; {s['rounds']} "
        "round(s) interleaved (seeds "
        f"{', '.join(map(str, range(s['rounds'])))}), step sizes tuned on {s['tune_seeds']} seed(s) from 100. "
        "Times are medians over rounds (a mark never reached counting as never), with how many reached it."
        + load_line(results["runs"]),
        "",
        table(results),
        "",
    ]
    if results["ratios"]:
        parts.append(
            "Time to 88% over dynabatch's, per round (above 1: dynabatch faster; – where either never "
            "reached it): "
            + "; ".join(
                f"{SYSTEMS[k].label}: " + ", ".join("–" if x is None else f"{x:.2f}" for x in v)
                for k, v in results["ratios"].items()
            )
            + "."
        )
        parts.append("")
    if results["runs"]:
        parts += ["Per round (each system's run of that round; above 1: the dynabatch run was faster):", ""]
        parts += [rounds_table(results), ""]
    for key, why in results["skipped"].items():
        parts.append(f"- {SYSTEMS[key].label}: skipped, {why}")
    if results["tuning"]:
        parts += ["", "Step sizes tried (tuning seeds):", "", tuning_table(results)]
    parts += ["", f"![accuracy against time since launch]({img}peers.png)", ""]
    return "\n".join(parts)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Test accuracy of every reported run against time since launch, one colour per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import accuracy_axis, save

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap, labelled = plt.get_cmap("tab10"), set()
    keys = list(dict.fromkeys(r["system"] for r in results["runs"]))
    for r in results["runs"]:
        if r["curve"]:
            label = None if r["system"] in labelled else SYSTEMS[r["system"]].label
            labelled.add(r["system"])
            ax.plot(
                [p[0] for p in r["curve"]],
                [100 * p[2] for p in r["curve"]],
                color=cmap(keys.index(r["system"])),
                alpha=0.8,
                linewidth=1.2,
                label=label,
            )
    accuracy_axis(ax, "seconds since launch", (60, 92))
    return save(fig, [ax], "4 workers at 1, 1, 2, 4x: each system at its tuned step size", path)


def write(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "peers.png")
    (out / "report.md").write_text(render(results))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    summary, details = (__doc__ or "").split("\n\n", 1)
    p = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=summary,
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(FULL.systems))
    p.add_argument("--budget-s", type=float, default=FULL.budget_s, help="seconds from each launch to its stop")
    p.add_argument("--rounds", type=int, default=FULL.rounds, help="reported rounds (seeds 0, 1, ...)")
    p.add_argument("--tune-seeds", type=int, default=FULL.tune_seeds, help="tuning seeds (100, 101, ...)")
    p.add_argument("--snapshot-s", type=float, default=FULL.snapshot_s)
    p.add_argument("--eval-samples", type=int, default=FULL.eval_samples, help="test images scoring a snapshot")
    p.add_argument("--lr", nargs="+", default=[], metavar="SYSTEM=LR", help="use this step size, do not tune")
    p.add_argument(
        "--tune-budget-s",
        nargs="+",
        default=[],
        metavar="SYSTEM=S",
        help="tune SYSTEM at this budget (default: --budget-s)",
    )
    p.add_argument(
        "--lock",
        default="",
        metavar="FILE",
        help="hold FILE's lock and run at normal priority only while a run trains (start the command niced)",
    )
    p.add_argument(
        "--max-runs", type=int, default=0, help="start at most this many new runs, then stop (the next call goes on)"
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/peers"))
    p.add_argument("--data-dir", default="")
    p.add_argument("--report-only", type=Path, metavar="DIR", help="re-render DIR's report from its results.json")
    args = p.parse_args(argv)
    for name in ("lr", "tune_budget_s"):
        flag = "--" + name.replace("_", "-")
        try:
            pairs = tuple((k, float(v)) for k, v in (item.split("=", 1) for item in getattr(args, name)))
        except ValueError:
            p.error(f"{flag}: expected SYSTEM=NUMBER, got {getattr(args, name)}")
        unknown = [k for k, _ in pairs if k not in SYSTEMS]
        if unknown:
            p.error(f"{flag}: unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
        setattr(args, name, pairs)
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.report_only:
        write(json.loads((args.report_only / "results.json").read_text()), args.report_only)
        return 0
    settings = replace(
        FULL,
        systems=tuple(args.systems),
        budget_s=args.budget_s,
        rounds=args.rounds,
        tune_seeds=args.tune_seeds,
        snapshot_s=args.snapshot_s,
        eval_samples=args.eval_samples,
        lrs=args.lr,
        tune_budgets=args.tune_budget_s,
        max_runs=args.max_runs,
        lock=args.lock,
    )

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        results = compare(settings, args.out, args.data_dir, progress)
    except Paused as stop:
        progress(f"[peers] paused: {stop}")
        return 0
    results["command"] = " ".join(["python", "-m", "bench.peers", *argv])
    write(results, args.out)
    progress(f"report: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
