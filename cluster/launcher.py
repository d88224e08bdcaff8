"""The one place that starts dynabatch's processes as children, and stops them in order.

`dynabatch run`, the integration tests (tests/harness.py) and the benchmarks all
start roles through `Launcher`, so a role's command line, its /metrics port, its
CURVE folder, its log file, its environment and the order of shutdown are decided
here once. Children run in their own sessions, so a Ctrl-C reaches only the
process that started them, which then stops workers first, then the evaluator,
then shards (which checkpoint on SIGTERM), then the scheduler: nothing is killed
mid-write, and every client can still say BYE to a live scheduler.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from dynabatch.common.curve import KEYS_BY_ROLE
from dynabatch.common.ports import free_port

STOP_ORDER = ("worker", "evaluator", "ps", "scheduler")
KEY_ROLES = ("scheduler", "ps", "worker", "evaluator")  # each reads its own key files
STOP_TIMEOUT_S = 15.0


def command_line(command: str, flags: Sequence[str] = (), python_args: Sequence[str] = ()) -> list[str]:
    """`dynabatch COMMAND FLAGS` run by this interpreter (`python_args` go before `-m`, e.g. cProfile's)."""
    return [sys.executable, *python_args, "-m", "dynabatch.cli.main", command, *flags]


def child_env() -> dict[str, str]:
    """This process's environment, unbuffered, so a child's log is complete up to the moment it dies."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def shared_keys(curve_dir: str) -> dict[str, str]:
    """Every role reads its own files from one folder, as `dynabatch run --curve-dir` gives them."""
    return {role: curve_dir for role in KEY_ROLES} if curve_dir else {}


def keys_per_role(curve_dir: str, into: Path) -> dict[str, str]:
    """A folder per role under `into` holding only the key files that role reads, as Kubernetes mounts them.

    A process that reads a file its role should not need then fails, which one
    shared folder would hide.
    """
    folders = {}
    for role in KEY_ROLES:
        folder = into / f"curve-{role}"
        folder.mkdir(exist_ok=True)
        for name in KEYS_BY_ROLE[role]:
            shutil.copy(Path(curve_dir) / name, folder / name)
        folders[role] = str(folder)
    return folders


def _popen(cmd: list[str], log_path: Path, pipe_stdout: bool) -> subprocess.Popen:
    """`cmd` in a session of its own, its output (stderr only, with `pipe_stdout`) appended to `log_path`."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE if pipe_stdout else log_file, stderr=log_file,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=child_env())


@dataclass
class Child:
    """One started process: `metrics_port` is 0 for a process that serves no /metrics."""

    role: str
    name: str
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str] = field(default_factory=list)
    restarts: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self, timeout_s: float = 5.0) -> str:
        """Its /metrics page, as Prometheus would scrape it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@dataclass
class Launcher:
    """A job's child processes on 127.0.0.1, their logs in `log_dir`.

    `curve_dirs` maps a role (an evaluator's apart from a worker's) to the `--curve-dir` it gets (see
    `shared_keys` and `keys_per_role`); without an entry a role runs without
    CURVE. `prefix` goes before every child's name, so that several launchers can
    share one log folder.
    """

    log_dir: Path
    curve_dirs: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.scheduler_endpoint = f"tcp://127.0.0.1:{free_port()}"

    def spawn(self, name: str, role: str, cmd: list[str], pipe_stdout: bool = False, metrics_port: int = 0) -> Child:
        """Start any command with its output (stderr only, with `pipe_stdout`) in log_dir/PREFIX+NAME.log."""
        name = self.prefix + name
        log_path = self.log_dir / f"{name}.log"
        child = Child(role, name, metrics_port, _popen(cmd, log_path, pipe_stdout), log_path, cmd)
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start `child`'s command again, in its place: same flags, ports and log file (appended to).

        A shard comes back on its endpoint (workers reconnect to it) and resumes
        from its checkpoint; the scheduler on its endpoint resumes from its saved
        progress (--state-dir).
        """
        with open(child.log_path, "ab") as log_file:
            log_file.write(f"--- exited with {child.proc.returncode}; restarted by the launcher ---\n".encode())
        again = Child(child.role, child.name, child.metrics_port, _popen(child.cmd, child.log_path, False),
                      child.log_path, child.cmd, child.restarts + 1)
        self.children[self.children.index(child)] = again
        return again

    def start(self, command: str, name: str, flags: Sequence[str], role: str = "",
              python_args: Sequence[str] = ()) -> Child:
        """Start `dynabatch COMMAND FLAGS` as ROLE (default: the command), serving /metrics on a port of its own."""
        port = free_port()
        cmd = command_line(command, [*flags, "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                                     "--curve-dir", self.curve_dirs.get(role or command, "")], python_args)
        return self.spawn(name, role or command, cmd, metrics_port=port)

    def start_scheduler(self, flags: Sequence[str]) -> Child:
        """The scheduler at `scheduler_endpoint`; it stays up after the job ends, until it is stopped."""
        return self.start("scheduler", "scheduler", ["--bind", self.scheduler_endpoint, "--no-exit-on-finish", *flags])

    def start_shard(self, index: int, name: str, flags: Sequence[str] = (), port: int | None = None,
                    python_args: Sequence[str] = ()) -> Child:
        """Shard `index` bound to `port` (a free one by default: a restarted shard passes its old one)."""
        return self.start("ps", name, ["--scheduler", self.scheduler_endpoint, "--bind",
                                       f"tcp://127.0.0.1:{port or free_port()}", "--shard-index", str(index), *flags],
                          python_args=python_args)

    def start_worker(self, name: str, flags: Sequence[str] = (), evaluator: bool = False) -> Child:
        return self.start("worker", name, ["--scheduler", self.scheduler_endpoint, "--name", name, *flags,
                                           *(["--evaluator"] if evaluator else [])],
                          "evaluator" if evaluator else "worker")

    def failed(self, role: str) -> list[Child]:
        """Children of `role` that exited with an error."""
        return [c for c in self.children if c.role == role and c.proc.poll() not in (None, 0)]

    def running(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.alive()]

    def check_alive(self) -> None:
        """Raise RuntimeError with the log's tail of a child that exited, for callers that need every one up."""
        for c in self.children:
            if not c.alive():
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; its log ends:\n{c.log_tail(40)}")

    def stop(self, role: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every running child of `role`, wait, then SIGKILL what is left."""
        victims = self.running(role)
        for c in victims:
            c.proc.send_signal(signal.SIGTERM)
        for c in victims:
            try:
                c.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every child, role by role in STOP_ORDER; other children (a benchmark's drivers) go first."""
        others = [role for role in dict.fromkeys(c.role for c in self.children) if role not in STOP_ORDER]
        for role in (*others, *STOP_ORDER):
            self.stop(role, timeout_s)

    def write_targets(self, job: str, path: Path) -> Path:
        """A Prometheus file_sd list of every child's /metrics, labelled by role and name.

        `job` is the job's name, as in Kubernetes, where the monitors take Prometheus'
        `job` label from the dynabatch.io/job pod label: the dashboard selects by it.
        """
        targets = [{"targets": [f"127.0.0.1:{c.metrics_port}"], "labels": {"job": job, "role": c.role, "name": c.name}}
                   for c in self.children if c.metrics_port]
        path.write_text(json.dumps(targets, indent=2))
        return path
