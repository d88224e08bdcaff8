"""Scale: many light workers against 1, 2 and 4 shards.

A light worker speaks the whole worker protocol (HELLO, heartbeats with step
counts and times that drive the scheduler's speed model and batch allocation,
PULL and PUSH of every chunk) but computes nothing, so the scheduler and the
shards see the load of many fast workers without 32 copies of the CNN competing
for two cores. Light workers live several to a driver process; a driver sends
every worker's pull before it waits for any, so the shards see concurrent
requests. Measured: shard updates applied per second (from the shards'
heartbeat counts in the scheduler's STATUS, over a window once every worker
trains) and the scheduler's decision latency (time to handle a heartbeat,
which includes refitting the speed model and re-solving the allocation).

Run one driver by hand with `python -m bench.scale --driver --scheduler tcp://HOST:PORT --workers K`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from bench.transport import QUIET
from dynabatch.cluster.launcher import Launcher
from dynabatch.common.config import job_from_dict
from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.tasks.builtin_tasks import builtin_init
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import (
    Hello,
    JobStatus,
    Role,
    StatusReply,
    StatusRequest,
    WorkerAssignment,
    WorkerHeartbeat,
)
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.worker.ps_client import PendingPush, ShardClients

PARAMS = 200_000  # a small model: the cost is per message and per update, not per byte
CHUNK_BYTES = 64 << 10  # 13 chunks, so four shards each own some
HEARTBEAT_EVERY_S = 0.1  # as a worker whose steps take 100 ms
STANDALONE_SPS = 1000.0
REQUEST_TIMEOUT_S = 60.0
DRIVERS_MAX = 4
GRAD_VALUE = 1e-6


@dataclass(frozen=True)
class Settings:
    workers: tuple[int, ...]
    shards: tuple[int, ...]
    window_s: float


@dataclass
class ScaleResult:
    workers: int
    shards: int
    updates_per_s: float | None
    worker_steps_per_s: float | None
    decision_mean_s: float | None
    decision_p99_s: float | None
    decisions: int
    error: str = ""


class LightWorker:
    """One registered worker that pulls and pushes but does not compute."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], scheduler: str, name: str) -> None:
        link = SchedulerLink(ctx, scheduler, "dynabatch", name, WorkerHeartbeat, WorkerAssignment)
        welcome = link.register(Hello(role=Role.WORKER, name=name), lambda: False, lambda: None)
        assert welcome is not None, "registration only ends with a WELCOME when nothing asks it to stop"
        self.control = link.conn
        job = job_from_dict(welcome.config)
        init, flat = builtin_init(job)
        total = flat.numel()
        self.clients = ShardClients(
            ctx, welcome.shards, make_layout(total, job.chunk_bytes, job.shards), job.job, welcome.id
        )
        self.clients.init(init, flat, 30.0)
        self.grad = torch.full((total,), GRAD_VALUE)
        self.hb = WorkerHeartbeat(standalone_sps=STANDALONE_SPS)
        self.batch = 0
        self.last_hb = 0.0

    def heartbeat(self) -> None:
        try:
            self.batch = self.control.request(self.hb, timeout_s=2.0).body.batch
        except TimeoutError:
            return
        self.last_hb = time.monotonic()

    def pushed(self, push: PendingPush) -> None:
        """Wait for `push`. One refused for carrying more than this worker's batch (the batch shrank as others
        joined, after the heartbeat that told it) is a lost step, as for a real worker: ask for the batch now."""
        try:
            self.clients.wait(push, REQUEST_TIMEOUT_S)
        except RemoteError as exc:
            if exc.code != ErrorCode.BAD_FIELD:
                raise
            self.heartbeat()

    def record(self, step_s: float) -> None:
        hb = self.hb
        self.hb = WorkerHeartbeat(
            steps=hb.steps + 1,
            samples=hb.samples + self.batch,
            batch=self.batch,
            times=StepTimes(step_s=step_s, pull_s=step_s / 2, push_s=step_s / 2),
            standalone_sps=STANDALONE_SPS,
        )
        if time.monotonic() - self.last_hb >= HEARTBEAT_EVERY_S:
            self.heartbeat()


def driver_main(argv: list[str]) -> None:
    """Run `--workers` light workers until SIGTERM."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--driver", action="store_true")
    p.add_argument("--scheduler", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--prefix", default="light")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ctx = zmq.Context()
    workers = [LightWorker(ctx, args.scheduler, f"{args.prefix}-{i}") for i in range(args.workers)]
    for w in workers:
        while not w.batch:
            w.heartbeat()
        pulled = w.clients.pull(None, REQUEST_TIMEOUT_S)  # the first push resends itself until the shards know w
        w.pushed(w.clients.start_push(w.grad, pulled.chunk_versions, w.batch, 0.0))
    while True:  # until SIGTERM, whose default action ends the process
        start = time.perf_counter()
        pulls = [w.clients.start_pull() for w in workers]
        for w, pull in zip(workers, pulls, strict=True):
            w.clients.wait(pull, REQUEST_TIMEOUT_S)
        pushes = [
            w.clients.start_push(w.grad, pull.result().chunk_versions, w.batch, 0.0)
            for w, pull in zip(workers, pulls, strict=True)
        ]
        for w, push in zip(workers, pushes, strict=True):
            w.pushed(push)
        step_s = time.perf_counter() - start
        for w in workers:
            w.record(step_s)


def _status(conn: Connection) -> JobStatus | None:
    try:
        reply = conn.request(StatusRequest(), timeout_s=5.0)
    except (TimeoutError, RemoteError):
        return None
    return reply.body.state if isinstance(reply.body, StatusReply) else None


def measure(workers: int, shards: int, window_s: float, launcher: Launcher) -> ScaleResult:
    """Scheduler + `shards` shards + `workers` light workers; updates/s over `window_s` once all train."""
    launcher.start_scheduler(
        [
            "--model",
            f"flat:{PARAMS}",
            "--dataset",
            "synthetic",
            "--epochs",
            "1e9",
            "--chunk-bytes",
            str(CHUNK_BYTES),
            "--shards",
            str(shards),
            "--liveness-timeout-s",
            "60",
            *QUIET,
        ]
    )
    for i in range(shards):
        launcher.start_shard(i, f"ps{i}", QUIET)
    scheduler = launcher.scheduler_endpoint
    drivers = min(DRIVERS_MAX, workers)
    for d in range(drivers):
        count = workers // drivers + (1 if d < workers % drivers else 0)
        launcher.spawn(
            f"driver{d}",
            "driver",
            [
                sys.executable,
                "-m",
                "bench.scale",
                "--driver",
                "--scheduler",
                scheduler,
                "--workers",
                str(count),
                "--prefix",
                f"d{d}",
            ],
        )
    conn = Connection(zmq.Context.instance(), scheduler, "dynabatch", "bench-scale")
    try:
        deadline = time.monotonic() + 120 + 5 * workers
        while True:
            launcher.check_alive()
            state = _status(conn)
            if state and len(state.workers) == workers and all(w.steps > 1 for w in state.workers.values()):
                break
            if time.monotonic() > deadline:
                return ScaleResult(workers, shards, None, None, None, None, 0, "workers never all trained")
            conn.recv(0.2)
        first = state
        conn.recv(window_s)
        last = _status(conn)
    finally:
        conn.close()
    if last is None:
        return ScaleResult(workers, shards, None, None, None, None, 0, "no status at the end of the window")
    dt = last.t - first.t
    updates = sum(s.version for s in last.shards.values()) - sum(s.version for s in first.shards.values())
    steps = sum(w.steps for w in last.workers.values()) - sum(w.steps for w in first.workers.values())
    latency = last.decision_s
    return ScaleResult(workers, shards, updates / dt, steps / dt, latency.mean, latency.p99, latency.count)


def run_all(settings: Settings, log_dir: Path, progress: Callable[[str], None]) -> list[ScaleResult]:
    """Every (workers, shards) pair, each on a fresh scheduler and shards."""
    results = []
    for n in settings.workers:
        for s in settings.shards:
            launcher = Launcher(log_dir, prefix=f"scale-{n}w-{s}s-")
            try:
                r = measure(n, s, settings.window_s, launcher)
            except RuntimeError as exc:
                r = ScaleResult(n, s, None, None, None, None, 0, str(exc).splitlines()[0])
            finally:
                launcher.stop_all()
            results.append(r)
            progress(
                f"[scale] {n} workers, {s} shard(s): "
                + (
                    f"{r.updates_per_s:.0f} updates/s, decision {1e6 * r.decision_mean_s:.0f} us mean / "
                    f"{1e6 * r.decision_p99_s:.0f} us p99"
                    if r.updates_per_s is not None and r.decision_mean_s is not None and r.decision_p99_s is not None
                    else f"FAILED ({r.error})"
                )
            )
    return results


def to_json(results: list[ScaleResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


if __name__ == "__main__":
    driver_main(sys.argv[1:])
