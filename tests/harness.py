"""Real processes on 127.0.0.1 for the integration tests.

Each role runs as `python -m dynabatch.cli.main ROLE` with its log in the test's
tmp folder; `Client` talks to them over real sockets with the real codec.
Waiting is always for a condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from dynabatch.common.curve import KEYS_BY_ROLE, CurveKeys
from dynabatch.common.messages import Heartbeat, Hello, JobStatus, StatusRequest, Welcome
from dynabatch.common.ports import free_port
from dynabatch.common.scheduler_link import SchedulerLink
from dynabatch.common.transport import Connection, use_curve


def run_job(out: Path, name: str, *flags: str, timeout_s: float = 300) -> tuple[Path, str]:
    """`dynabatch run` to its end: (run folder, what it printed); a failure shows the run's output and the tail of every process's log.

    The run gets a deadline of its own, shorter than the test's, so that a job
    that hangs is stopped by `dynabatch run` and leaves its logs behind.
    """
    cmd = [sys.executable, "-m", "dynabatch.cli.main", "run", "--out", str(out), "--name", name,
           "--timeout-s", str(timeout_s - 30), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run_dir = out / name
    if done.returncode != 0:
        tails = "".join(f"\n--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
                        for log in sorted((run_dir / "logs").glob("*.log")))
        raise AssertionError(f"dynabatch run exited {done.returncode}\n{done.stdout}{done.stderr}{tails}")
    return run_dir, done.stdout


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float = 60.0, every_s: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    metrics_port: int

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return 0.0


@dataclass
class Cluster:
    """Processes of one job; everything started is stopped at teardown.

    With `curve_dir` every process and the test's own clients use those CURVE keys
    (the clients on a context of their own, so other tests' clients stay plain);
    each process gets a folder of its own holding only the files its role reads,
    as the Kubernetes manifests mount them.
    """

    tmp: Path
    job_flags: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    curve_dir: str = ""

    def __post_init__(self) -> None:
        self.scheduler_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.ctx = zmq.Context.instance()
        self.role_curve_dirs: dict[str, str] = {}
        if self.curve_dir:
            self.ctx = zmq.Context()
            use_curve(self.ctx, CurveKeys.load(self.curve_dir, "worker"))
            for role, files in KEYS_BY_ROLE.items():
                folder = self.tmp / f"curve-{role}"
                folder.mkdir(exist_ok=True)
                for name in files:
                    shutil.copy(Path(self.curve_dir) / name, folder / name)
                self.role_curve_dirs[role] = str(folder)

    def start(self, role: str, name: str, *flags: str) -> Proc:
        port = free_port()
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "dynabatch.cli.main", role, *flags,
               "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--curve-dir", self.role_curve_dirs.get(role, "")]
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        p = Proc(name, proc, log, port)
        self.procs.append(p)
        return p

    def scheduler(self, *extra: str) -> Proc:
        return self.start("scheduler", "scheduler", "--bind", self.scheduler_endpoint, "--no-exit-on-finish",
                          *self.job_flags, *extra)

    def shard(self, index: int = 0, port: int | None = None, *extra: str) -> Proc:
        port = port or free_port()
        return self.start("ps", f"ps{index}-{len(self.procs)}", "--scheduler", self.scheduler_endpoint,
                          "--bind", f"tcp://127.0.0.1:{port}", "--shard-index", str(index), *extra)

    def worker(self, name: str, *extra: str) -> Proc:
        return self.start("worker", name, "--scheduler", self.scheduler_endpoint, "--name", name, *extra)

    def client(self, endpoint: str | None = None, sender: str = "test", job: str = "dynabatch") -> Connection:
        return Connection(self.ctx, endpoint or self.scheduler_endpoint, job, sender)

    def status(self) -> JobStatus | None:
        conn = self.client()
        try:
            return conn.request(StatusRequest(), timeout_s=2.0).body.state
        except TimeoutError:
            return None
        finally:
            conn.close()

    def wait_status(self, what: str, predicate: Callable[[JobStatus], bool], timeout_s: float = 60.0) -> JobStatus:
        def check() -> JobStatus | None:
            st = self.status()
            return st if st is not None and predicate(st) else None

        return wait_for(what, check, timeout_s, every_s=0.2)

    def join_as_worker(self, standalone_sps: float = 1000.0) -> tuple[Connection, Welcome]:
        """Register a test client as a worker, as the worker does, and heartbeat until it holds a batch."""
        link = SchedulerLink(self.ctx, self.scheduler_endpoint, "dynabatch", "test-worker")
        deadline = time.monotonic() + 30
        welcome = link.register(Hello(role="worker", name="test-worker"), lambda: time.monotonic() > deadline,
                                lambda: None)
        assert welcome is not None, "timed out after 30s waiting for the scheduler to welcome a worker"
        conn = link.conn

        def has_batch() -> bool:
            reply = conn.request(Heartbeat(standalone_sps=standalone_sps), timeout_s=2.0)
            return reply.body.batch > 0

        wait_for("a batch for the test worker", has_batch, 30)
        return conn, welcome

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()

