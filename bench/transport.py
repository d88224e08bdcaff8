"""Transport benchmark: a real dynabatch shard's pull+push throughput against raw ZeroMQ.

A worker's step moves the whole model twice (PULL the parameters, PUSH a
gradient of the same size), so on a fast network the parameter server's
transport bounds training speed. This compares the real thing (a `dynabatch
scheduler` and `dynabatch ps` as separate processes, a client registered as a
worker using the workers' own `ShardClients`) with the ceiling on the same
loopback: a bare ZeroMQ ROUTER that answers the same pull+push pattern with one
zero-copy buffer per message and does nothing else.

The two are measured in alternating blocks within one run, so the noise of a
shared machine hits both alike and their ratio means something even when the
absolute numbers do not. Run from the repository root:

    python bench/transport.py [--sizes 1M 10M] [--quick] [--out DIR] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import platform
import pstats
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import zmq

from dynabatch.cluster.launcher import Launcher
from dynabatch.common.base_lr import base_lr
from dynabatch.common.config import JobConfig, job_from_dict
from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.tasks.builtin_tasks import builtin_init
from dynabatch.common.tasks.catalog import MODELS
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import Hello, Role, WorkerAssignment, WorkerHeartbeat
from dynabatch.worker.ps_client import ShardClients

DEFAULT_SIZES = ("1M", "10M")
DEFAULT_OUT = Path("bench/results/transport")
TARGET_RATIO = 0.70
PUSH_PULL_TARGET = 0.80  # push+pull against raw, from 1M parameters up (issue 12)
REQUEST_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 60.0
RAW_PULL_REQUEST_BYTES = 8  # a raw pull request is the wanted byte count as 8 little-endian bytes
RAW_ACK = b"ok"
GRAD_VALUE = 1e-4  # small enough that thousands of SGD steps leave the parameters finite
BYTES_PER_PARAM = 4
CLIENT_THREADS = 1  # as `dynabatch worker --threads` defaults to


@dataclass(frozen=True)
class Settings:
    """How much to measure: per size, `warmup` untimed steps, then `rounds` of one block each."""

    rounds: int
    block_bytes: int  # each block moves about this much, so small and large sizes take similar time
    warmup: int
    min_block: int = 3
    max_block: int = 500

    def block_steps(self, step_bytes: int) -> int:
        return max(self.min_block, min(self.max_block, round(self.block_bytes / step_bytes)))


FULL = Settings(rounds=8, block_bytes=800_000_000, warmup=3)
QUICK = Settings(rounds=3, block_bytes=200_000_000, warmup=2)


class Target(Protocol):
    """Something that does one pull+push step; `step_bytes` is the payload it moves, `server_pids` the
    processes that answer it (their CPU time is counted per block, with this process's)."""

    step_bytes: int
    server_pids: tuple[int, ...]

    def step(self) -> None: ...


def log(text: str) -> None:
    """Progress goes to stderr so stdout holds only the table."""
    print(text, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """'1M', '0.1M', '250k' or '1000000' -> a parameter count."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    value = round(float(number) * scale)
    if value < 10:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 10 parameters")
    return value


def size_label(params: int) -> str:
    """'1M', '0.1M', '0.235M', '50k': how sizes appear in logs and the table."""
    return f"{params / 1e6:.3g}M" if params >= 100_000 else f"{params / 1e3:.3g}k"


def run_label(model: str, params: int) -> str:
    """The size for the flat model, else the model's name (its size is known only once it is built)."""
    return size_label(params) if model == "flat" else model


# -- processes -------------------------------------------------------------------------


QUIET = ("--log-level", "WARNING")  # a benchmark's children log only what goes wrong


def wait_for(what: str, attempt: Callable[[], object], launcher: Launcher) -> object:
    """Retry `attempt` until it returns something truthy; children dying or a timeout fail it."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        launcher.check_alive()
        value = attempt()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {STARTUP_TIMEOUT_S:.0f}s waiting for {what}")


# -- dynabatch -------------------------------------------------------------------------


def job_flags(model: str, params: int, chunk_bytes: int, shards: int = 1) -> list[str]:
    """A job that never ends by itself and never drops the benchmark's silent worker."""
    return [
        "--model",
        f"flat:{params}" if model == "flat" else model,
        "--dataset",
        "synthetic",
        "--epochs",
        "1e9",
        "--chunk-bytes",
        str(chunk_bytes),
        "--shards",
        str(shards),
        "--liveness-timeout-s",
        "3600",
        "--join-timeout-s",
        "3600",
    ]


class DynabatchTarget:
    """A real scheduler and `shards` shards, and this process registered as a worker of their job."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        launcher: Launcher,
        model: str,
        params: int,
        chunk_bytes: int,
        shard_profile: Path | None = None,
        shards: int = 1,
    ) -> None:
        launcher.start_scheduler([*job_flags(model, params, chunk_bytes, shards), *QUIET])
        for i in range(shards):
            profile = ["-m", "cProfile", "-o", str(shard_profile)] if shard_profile and i == 0 else []
            launcher.start_shard(i, f"ps{i}", QUIET, python_args=profile)
        link = SchedulerLink(ctx, launcher.scheduler_endpoint, "dynabatch", "bench", WorkerHeartbeat, WorkerAssignment)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            welcome = link.register(
                Hello(role=Role.WORKER, name="bench"), lambda: time.monotonic() > deadline, launcher.check_alive
            )
            if welcome is None:
                raise TimeoutError(
                    f"timed out after {STARTUP_TIMEOUT_S:.0f}s waiting for the scheduler to admit a worker"
                )
            wait_for("a batch for the benchmark worker", lambda: _has_batch(link.conn), launcher)
        finally:
            link.close()
        self.job: JobConfig = job_from_dict(welcome.config)
        init, flat = builtin_init(self.job)
        total = flat.numel()
        layout = make_layout(total, self.job.chunk_bytes, self.job.shards)
        self.clients = ShardClients(ctx, welcome.shards, layout, self.job.job, welcome.id)
        self.clients.init(init, flat, REQUEST_TIMEOUT_S)
        self.params = total
        self.step_bytes = 2 * total * BYTES_PER_PARAM
        self.server_pids = tuple(c.proc.pid for c in launcher.children if c.role == "ps")
        self.grad = torch.full((total,), GRAD_VALUE)
        wait_for("the shard to accept the benchmark worker's pushes", self._try_step, launcher)

    def step(self) -> None:
        """What a worker does around its compute: pull the model, push a gradient."""
        pulled = self.clients.pull(None, REQUEST_TIMEOUT_S)
        self.clients.push(self.grad, pulled.chunk_versions, self.job.global_batch, 0.0, REQUEST_TIMEOUT_S)
        self.versions = pulled.chunk_versions

    def push_pull_step(self) -> None:
        """The same step as `--push-pull` workers take it: one push whose answer is the next model."""
        pulled, _ = self.clients.push_pull(self.grad, self.versions, self.job.global_batch, 0.0, REQUEST_TIMEOUT_S)
        self.versions = pulled.chunk_versions

    def _try_step(self) -> bool:
        """The shard learns live workers from the scheduler's heartbeat replies, so it may not know us yet."""
        try:
            self.step()
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_SENDER:
                raise
            return False
        return True

    def close(self) -> None:
        self.clients.close()


class PushPullTarget:
    """A `DynabatchTarget`'s worker stepping with push+pull in one round trip."""

    def __init__(self, dyn: DynabatchTarget) -> None:
        self.step_bytes = dyn.step_bytes
        self.server_pids = dyn.server_pids
        self.step = dyn.push_pull_step


def _has_batch(conn: Connection) -> bool:
    try:
        batch: int = conn.request(WorkerHeartbeat(standalone_sps=1000.0), timeout_s=2.0).body.batch
        return batch > 0
    except TimeoutError:
        return False


# -- raw ZeroMQ ------------------------------------------------------------------------


def serve_raw(update: bool) -> None:
    """The ceiling's server: answer a pull with N bytes and a push with an ack, nothing else.

    With `update` it also does the arithmetic any parameter server must, at its cheapest:
    a push is checked finite and applied in place, as SGD with the job's default momentum,
    weight decay and rate, to parameters of its size, and a pull answers with those
    parameters (in place, a pull being sent may see a later step: a ceiling may cut that
    corner, a shard may not). What is left between this ceiling and dynabatch is
    dynabatch's own cost (codec, chunks, validation, new tensors per step, bookkeeping).
    It prints its endpoint on stdout and runs until it is terminated.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    torch.set_num_threads(1)  # as `dynabatch ps --threads` defaults to
    job = JobConfig()
    params: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by size in bytes: parameters, momentum buffer

    def state(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if size not in params:
            params[size] = (torch.zeros(size // BYTES_PER_PARAM), torch.zeros(size // BYTES_PER_PARAM))
        return params[size]

    payload = bytearray()
    while True:
        identity, frame = sock.recv_multipart(copy=False)
        if frame.buffer.nbytes == RAW_PULL_REQUEST_BYTES:
            size = int.from_bytes(frame.buffer, "little")
            if update:
                param, _ = state(size)
                sock.send_multipart([identity, param.numpy().data.cast("B")], copy=False)
                continue
            if len(payload) < size:
                payload = bytearray(size)
            sock.send_multipart([identity, memoryview(payload)[:size]], copy=False)
        else:
            if update:
                grad = torch.frombuffer(frame.buffer, dtype=torch.float32)
                param, buf = state(frame.buffer.nbytes)
                if bool(torch.isfinite(grad.sum())):
                    buf.mul_(job.momentum).add_(grad).add_(param, alpha=job.weight_decay)
                    param.add_(buf, alpha=-base_lr(job))
            sock.send_multipart([identity, RAW_ACK], copy=False)


class RawTarget:
    """A DEALER doing the same pull+push as a worker with one buffer per message, no codec."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], server: tuple[str, int], params: int) -> None:
        endpoint, pid = server
        self.step_bytes = 2 * params * BYTES_PER_PARAM
        self.server_pids: tuple[int, ...] = (pid,)
        self.request = (params * BYTES_PER_PARAM).to_bytes(RAW_PULL_REQUEST_BYTES, "little")
        self.grad = torch.full((params,), GRAD_VALUE).numpy().data.cast("B")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def step(self) -> None:
        self.sock.send(self.request, copy=False)
        self.sock.recv(copy=False)
        self.sock.send(self.grad, copy=False)
        self.sock.recv(copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


def start_raw_server(launcher: Launcher, update: bool) -> tuple[str, int]:
    """Run `serve_raw` in its own process (like a shard); its endpoint and process id."""
    mode = "update" if update else "plain"
    server = launcher.spawn(
        f"raw-server-{mode}", "raw-server", [sys.executable, __file__, "--serve-raw", mode], pipe_stdout=True
    )
    assert isinstance(server.proc, subprocess.Popen) and server.proc.stdout is not None  # pipe_stdout: started afresh
    endpoint = server.proc.stdout.readline().decode().strip()
    if not endpoint:
        launcher.check_alive()
        raise RuntimeError("the raw ZeroMQ server printed no endpoint")
    return endpoint, server.proc.pid


# -- measuring -------------------------------------------------------------------------


@dataclass
class Side:
    """One target's result at one size; CPU milliseconds per step (medians over blocks) where /proc tells."""

    median_s: float
    mb_per_s: float
    steps_per_s: float
    steps: int
    client_cpu_ms: float | None = None  # this process: the worker's side, ZeroMQ's IO thread included
    server_cpu_ms: float | None = None  # the shard(s), or the raw server


@dataclass
class SizeResult:
    """Both targets at one model size; `ratio` is what the target of TARGET_RATIO is about."""

    size: str
    params: int
    step_bytes: int
    dynabatch: Side
    raw: Side
    chunk_bytes: int = JobConfig().chunk_bytes
    shards: int = 1
    push_pull: Side | None = None  # the same worker stepping with one round trip (older results lack it)
    raw_sgd: Side | None = None  # raw ZeroMQ whose server also checks and applies SGD (older results lack it)

    @property
    def ratio(self) -> float:
        return self.dynabatch.mb_per_s / self.raw.mb_per_s

    @property
    def push_pull_ratio(self) -> float | None:
        return self.push_pull.mb_per_s / self.raw.mb_per_s if self.push_pull else None

    @property
    def push_pull_sgd_ratio(self) -> float | None:
        """push+pull against the ceiling that does the same arithmetic: dynabatch's own overhead."""
        return self.push_pull.mb_per_s / self.raw_sgd.mb_per_s if self.push_pull and self.raw_sgd else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SizeResult:
        """Back from results.json (which also holds the derived ratios)."""
        fields = {k: v for k, v in d.items() if k not in ("ratio", "push_pull_ratio", "push_pull_sgd_ratio")}
        optional = {k: Side(**d[k]) if d.get(k) else None for k in ("push_pull", "raw_sgd")}
        return cls(**{**fields, "dynabatch": Side(**d["dynabatch"]), "raw": Side(**d["raw"]), **optional})


def cpu_seconds(pids: tuple[int, ...]) -> float:
    """CPU time (user + system, every thread) the processes have used so far; NaN without Linux's /proc."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return math.nan
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Measured:
    """One target's per-step times, and per block its CPU ms per step in this process and in its servers."""

    times: list[float]
    client_cpu_ms: list[float]
    server_cpu_ms: list[float]


def interleave(targets: dict[str, Target], settings: Settings, label: str) -> dict[str, Measured]:
    """Per-step times of each target, measured in alternating blocks after a warm-up.

    CPU is read per block (the kernel counts it in 10 ms ticks, too coarse for one step): it tells
    whether a gap in time is work (CPU) or waiting, and on whose side.
    """
    for target in targets.values():
        for _ in range(settings.warmup):
            target.step()
    me = (os.getpid(),)
    got = {name: Measured([], [], []) for name in targets}
    for r in range(settings.rounds):
        for name, target in targets.items():
            steps = settings.block_steps(target.step_bytes)
            client, server = cpu_seconds(me), cpu_seconds(target.server_pids)
            for _ in range(steps):
                start = time.perf_counter()
                target.step()
                got[name].times.append(time.perf_counter() - start)
            got[name].client_cpu_ms.append((cpu_seconds(me) - client) / steps * 1e3)
            got[name].server_cpu_ms.append((cpu_seconds(target.server_pids) - server) / steps * 1e3)
        medians = "  ".join(f"{n} {statistics.median(m.times) * 1e3:.2f} ms" for n, m in got.items())
        log(f"[{label}] round {r + 1}/{settings.rounds}: median step {medians}")
    return got


def summarize(measured: Measured, step_bytes: int) -> Side:
    """Medians, not means: a shared machine's stalls hit single steps, and must not set the result."""
    median = statistics.median(measured.times)
    cpu = [
        statistics.median(ms) if not any(map(math.isnan, ms)) else None
        for ms in (measured.client_cpu_ms, measured.server_cpu_ms)
    ]
    return Side(median, step_bytes / median / 1e6, 1 / median, len(measured.times), *cpu)


def measure_size(
    ctx: zmq.Context[zmq.Socket[bytes]],
    log_dir: Path,
    raw_servers: tuple[tuple[str, int], ...],
    model: str,
    params: int,
    chunk_bytes: int,
    settings: Settings,
    shards: int = 1,
) -> SizeResult:
    """Start a job of `params` parameters on `shards` shards and compare it with raw ZeroMQ, side by side."""
    label = f"{run_label(model, params)}-{chunk_bytes >> 10}K-S{shards}"
    log(f"[{label}] starting scheduler and {shards} shard(s)")
    launcher = Launcher(log_dir, prefix=f"{label}-")
    with ExitStack() as stack:
        stack.callback(launcher.stop_all)
        dyn = DynabatchTarget(ctx, launcher, model, params, chunk_bytes, shards=shards)
        stack.callback(dyn.close)
        raw, raw_sgd = (RawTarget(ctx, server, dyn.params) for server in raw_servers)
        stack.callback(raw.close)
        stack.callback(raw_sgd.close)
        times = interleave(
            {"dynabatch": dyn, "push+pull": PushPullTarget(dyn), "raw": raw, "raw+sgd": raw_sgd}, settings, label
        )
    return SizeResult(
        size_label(dyn.params),
        dyn.params,
        dyn.step_bytes,
        summarize(times["dynabatch"], dyn.step_bytes),
        summarize(times["raw"], raw.step_bytes),
        chunk_bytes,
        shards,
        summarize(times["push+pull"], dyn.step_bytes),
        summarize(times["raw+sgd"], raw.step_bytes),
    )


def profile_size(
    ctx: zmq.Context[zmq.Socket[bytes]],
    log_dir: Path,
    out: Path,
    model: str,
    params: int,
    chunk_bytes: int,
    settings: Settings,
) -> None:
    """Where a dynabatch push+pull step's time goes (as workers step by default): the client in-process and
    the shard, both under cProfile."""
    label = run_label(model, params)
    shard_prof = log_dir / f"shard-{label}.prof"
    launcher = Launcher(log_dir, prefix=f"{label}-")
    with ExitStack() as stack:
        stack.callback(launcher.stop_all)
        dyn = DynabatchTarget(ctx, launcher, model, params, chunk_bytes, shard_profile=shard_prof)
        stack.callback(dyn.close)
        for _ in range(settings.warmup):
            dyn.push_pull_step()
        steps = settings.rounds * settings.block_steps(dyn.step_bytes)
        log(f"[{label}] profiling {steps} dynabatch push+pull steps")
        profiler = cProfile.Profile()
        start = time.perf_counter()

        def profiled() -> None:
            for _ in range(steps):
                dyn.push_pull_step()

        profiler.runcall(profiled)
        elapsed = time.perf_counter() - start
    text = [
        f"# {label}: {steps} steps in {elapsed:.2f} s ({elapsed / steps * 1e3:.2f} ms/step, profiled)\n",
        "## client (this process)\n",
        _top(profiler),
        "## shard (dynabatch ps)\n",
        _top(str(shard_prof)),
    ]
    path = out / f"profile-{label}.txt"
    path.write_text("\n".join(text))
    log(f"[{label}] profile written to {path}")


def _top(profile: cProfile.Profile | str, lines: int = 25) -> str:
    """The `lines` functions of `profile` (a profiler, or the file one wrote) that took the most time themselves."""
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


# -- reporting -------------------------------------------------------------------------


def table(results: list[SizeResult]) -> str:
    """One row per size; a step is one pull plus one push, its time the median."""
    rows = [
        "| size | params | chunk | shards | dynabatch MB/s | raw ZeroMQ MB/s | ratio | dynabatch step | raw step "
        "| push+pull ratio | push+pull step | raw+sgd step | push+pull / raw+sgd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        fused = f"{r.push_pull_ratio:.2f} | {_step(r.push_pull)}" if r.push_pull else "– | –"
        sgd = (
            f"{_step(r.raw_sgd)} | {r.push_pull_sgd_ratio:.2f}"
            if r.raw_sgd and r.push_pull_sgd_ratio is not None
            else "– | –"
        )
        rows.append(
            f"| {r.size} | {r.params:,} | {r.chunk_bytes >> 10} KiB | {r.shards} | "
            f"{r.dynabatch.mb_per_s:,.0f} | {r.raw.mb_per_s:,.0f} | "
            f"{r.ratio:.2f} | {_step(r.dynabatch)} | {_step(r.raw)} | {fused} | {sgd} |"
        )
    return "\n".join(rows)


def cpu_table(results: list[SizeResult]) -> str:
    """Where each target's step goes in CPU: a target that takes longer without more CPU is waiting."""
    rows = [
        "| size | target | step | client CPU per step | server CPU per step | both |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        sides = {"dynabatch": r.dynabatch, "push+pull": r.push_pull, "raw": r.raw, "raw+sgd": r.raw_sgd}
        for name, side in sides.items():
            if side is None or side.client_cpu_ms is None or side.server_cpu_ms is None:
                continue
            rows.append(
                f"| {r.size} | {name} | {side.median_s * 1e3:.2f} ms | {side.client_cpu_ms:.2f} ms | "
                f"{side.server_cpu_ms:.2f} ms | {side.client_cpu_ms + side.server_cpu_ms:.2f} ms |"
            )
    return "\n".join(rows)


def _step(s: Side) -> str:
    return f"{s.median_s * 1e3:.2f} ms ({s.steps_per_s:,.0f}/s)"


TUNING_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)


def machine() -> dict[str, object]:
    """What the numbers depend on besides the code: thread counts and allocator settings move them a lot."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "env": {k: os.environ[k] for k in TUNING_ENV if k in os.environ},
    }


def write_results(out: Path, results: list[SizeResult], settings: Settings, command: str) -> None:
    """transport.json for machines, transport.md for people; both say how they were made."""
    m = machine()
    data = {
        "command": command,
        "machine": m,
        "settings": asdict(settings),
        "target_ratio": TARGET_RATIO,
        "push_pull_target": PUSH_PULL_TARGET,
        "results": [
            {
                **asdict(r),
                "ratio": r.ratio,
                "push_pull_ratio": r.push_pull_ratio,
                "push_pull_sgd_ratio": r.push_pull_sgd_ratio,
            }
            for r in results
        ],
    }
    (out / "transport.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [
        "# dynabatch transport benchmark",
        "",
        "One pull of every parameter plus one push of a same-sized gradient per step, on 127.0.0.1.",
        "dynabatch: real `dynabatch scheduler` and `dynabatch ps` processes, the workers' `ShardClients`;",
        "raw ZeroMQ: ROUTER/DEALER, one zero-copy buffer per message, no codec (the ceiling);",
        "raw+sgd: the same, its server also checking each push finite and applying the shard's SGD step.",
        "Blocks of the two alternate; times are medians per step; MB = 10^6 bytes of payload.",
        f"Targets: ratio >= {TARGET_RATIO:.2f}; push+pull ratio >= {PUSH_PULL_TARGET:.2f} from 1M parameters up.",
        "",
        table(results),
        "",
        "CPU per step, medians over blocks (user + system time of every thread, from /proc; the client is the",
        "benchmark process, ZeroMQ's IO thread included):",
        "",
        cpu_table(results),
        "",
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']} "
        f"({m['torch_threads']} threads in the client), pyzmq {m['pyzmq']} (libzmq {m['libzmq']}); "
        f"tuning environment: {m['env'] or 'none'}.",
        "",
        f"Command: `{command}`",
        "",
    ]
    (out / "transport.md").write_text("\n".join(md))


# -- main ------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[parse_size(s) for s in DEFAULT_SIZES],
        metavar="N",
        help=f"parameter counts of the flat model, e.g. 0.1M 250k 25M (default: {' '.join(DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--model",
        default="flat",
        choices=MODELS,
        help="job model (default: flat); the others have a fixed size and ignore --sizes",
    )
    parser.add_argument(
        "--client-threads",
        type=int,
        default=CLIENT_THREADS,
        metavar="N",
        help="torch threads of the benchmark's worker side (default: a worker's default --threads; "
        "more threads make each received chunk's copy a parallel one, which on a busy 2-core "
        "machine costs milliseconds of OpenMP wake-ups)",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=JobConfig().chunk_bytes,
        metavar="B",
        help="the job's chunk size (default: dynabatch's default)",
    )
    parser.add_argument("--shards", type=int, default=1, metavar="S", help="parameter-server shards (default 1)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for transport.json and transport.md (default: {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of comparing, profile the dynabatch side (client and shard) and write DIR/profile-SIZE.txt",
    )
    parser.add_argument("--serve-raw", choices=("plain", "update"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Case:
    """One transport measurement: the model size, the job's chunk size and its number of shards."""

    params: int
    chunk_bytes: int = JobConfig().chunk_bytes
    shards: int = 1


def compare(
    ctx: zmq.Context[zmq.Socket[bytes]], log_dir: Path, model: str, cases: list[Case], settings: Settings
) -> list[SizeResult]:
    """Every case against the two raw servers (plain, and applying SGD), which live for the whole run."""
    launcher = Launcher(log_dir)
    try:
        servers = (start_raw_server(launcher, False), start_raw_server(launcher, True))
        return [measure_size(ctx, log_dir, servers, model, c.params, c.chunk_bytes, settings, c.shards) for c in cases]
    finally:
        launcher.stop_all()


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the children are stopped too."""
    sys.exit(128 + signum)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.serve_raw:
        serve_raw(args.serve_raw == "update")
        return 0
    signal.signal(signal.SIGTERM, _exit_on_signal)
    settings = QUICK if args.quick else FULL
    torch.set_num_threads(args.client_threads)
    sizes = args.sizes if args.model == "flat" else [0]  # other models fix their own size
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="dynabatch-bench-") as tmp:
        log_dir = Path(tmp)
        if args.profile:
            for params in sizes:
                profile_size(ctx, log_dir, args.out, args.model, params, args.chunk_bytes, settings)
            return 0
        results = compare(ctx, log_dir, args.model, [Case(p, args.chunk_bytes, args.shards) for p in sizes], settings)
    command = shlex.join(["python", *sys.argv])
    print(table(results))
    print()
    print(cpu_table(results))
    write_results(args.out, results, settings, command)
    log(f"results written to {args.out}/transport.json and transport.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
