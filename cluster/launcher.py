"""The one place that starts dynabatch's processes as children, and stops them in order.

`dynabatch run`, the integration tests (tests/harness.py) and the benchmarks all
start roles through `Launcher`, so a role's command line, its /metrics port, its
CURVE folder, its log file, its environment and the order of shutdown are decided
here once. Children run in their own sessions, so a Ctrl-C reaches only the
process that started them, which then stops workers first, then the evaluator,
then shards (which checkpoint on SIGTERM), then the scheduler: nothing is killed
mid-write, and every client can still say BYE to a live scheduler. A parent that
cannot stop them (killed outright) takes them with it: each child gets SIGTERM from
the kernel when its parent dies (cluster/parent_death.py); `kill_all` is the forced
stop, a SIGKILL to each child's whole session.

Ports: a child binds its /metrics on port 0 and announces the port in its log, so no
other process can take it between a probe and the bind. The scheduler's and the shards'
ZeroMQ ports are fixed, because a restarted one must come back where its peers look;
one taken by another process before the child could bind is replaced by a fresh one
(`rebind`), which is safe only before the endpoint was given to anyone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dynabatch.cluster.parent_death import die_with_parent
from dynabatch.cluster.ports import free_port
from dynabatch.cluster.preloaded import ROLES as PRELOADED_ROLES
from dynabatch.cluster.preloaded import SUPPORTED as PRELOADING
from dynabatch.cluster.preloaded import ForkedProcess, Preloaded
from dynabatch.common.atomic_file import no_space_left, write_text_atomic
from dynabatch.common.net.curve import KEYS_BY_ROLE
from dynabatch.common.net.metrics import announced_port

STOP_ORDER = ("worker", "evaluator", "ps", "scheduler")
KEY_ROLES = ("scheduler", "ps", "worker", "evaluator")  # each reads its own key files
STOP_TIMEOUT_S = 15.0
METRICS_WAIT_S = 60.0  # a child's start (imports, data) before it binds /metrics, on a loaded machine
BIND_WAIT_S = 60.0  # the scheduler's start before it listens (0.3 s on a quiet machine)
BIND_ATTEMPTS = 5  # fresh ports tried for a child whose port another process took before it could bind
POLL_S = 0.02
ADDRESS_IN_USE = "Address already in use"  # EADDRINUSE as ZeroMQ's bind reports it


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


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


Process = subprocess.Popen[bytes] | ForkedProcess  # a child started afresh, or forked by the preloading process


def _popen(cmd: list[str], log_path: Path, pipe_stdout: bool) -> subprocess.Popen[bytes]:
    """`cmd` in a session of its own, its output (stderr only, with `pipe_stdout`) appended to `log_path`;
    it gets SIGTERM if this process dies (`die_with_parent`)."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE if pipe_stdout else log_file,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=child_env(),
            preexec_fn=die_with_parent(),
        )


@dataclass
class Child:
    """One started process.

    `serves_metrics`: it was told `--metrics-port 0` and announces the port it bound in
    its log (`metrics_port`). `endpoint`: the ZeroMQ endpoint it binds (`--bind`; the
    scheduler's and a shard's), a fixed port kept across restarts so that its peers find
    it again. `log_start` is where this run of the process begins in its log, which a
    restart appends to.
    """

    role: str
    name: str
    proc: Process
    log_path: Path
    cmd: list[str] = field(default_factory=list)
    restarts: int = 0
    serves_metrics: bool = False
    endpoint: str = ""
    rebinds: int = 0
    log_start: int = 0
    _metrics_port: int | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def announced_metrics_port(self) -> int | None:
        """The port its /metrics server bound, once its log says so (None before, or for a process with none)."""
        if self._metrics_port is None and self.serves_metrics:
            self._metrics_port = announced_port(self.log_since_start())
        return self._metrics_port

    @property
    def metrics_port(self) -> int:
        """The port of its /metrics (0 for a process that serves none), waiting for it to be bound.

        RuntimeError with the log's tail if the process exits first; TimeoutError past METRICS_WAIT_S.
        """
        if not self.serves_metrics:
            return 0
        deadline = time.monotonic() + METRICS_WAIT_S
        while (port := self.announced_metrics_port()) is None:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before serving /metrics; "
                    f"its log ends:\n{self.log_tail(40)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} announced no /metrics port in {METRICS_WAIT_S:.0f}s")
            _wait_exit(self.proc, POLL_S)
        return port

    def metrics(self, timeout_s: float = 5.0) -> str:
        """Its /metrics page, as Prometheus would scrape it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=timeout_s) as r:
            page: bytes = r.read()
        return page.decode()

    def listening(self) -> bool:
        """Its log since this start has the INFO line naming its endpoint that it writes once bound there."""
        return (
            bool(self.endpoint)
            and re.search(rf"^\S+ INFO \S+: .*{re.escape(self.endpoint)}(?!\d)", self.log_since_start(), re.M)
            is not None
        )

    def port_taken(self) -> bool:
        """It exited at its first start, before it ever listened, because another process held its port."""
        return (
            bool(self.endpoint)
            and self.restarts == 0
            and self.proc.poll() not in (None, 0)
            and ADDRESS_IN_USE in self.log_since_start()
            and not self.listening()
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_since_start(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def reason(self) -> str:
        """Why it exited, as it said so itself: its log since this start from its last `dynabatch COMMAND: `
        line on (a command's one-line refusal); on a full disk, which its log could not take, that;
        else the last line of its log."""
        text = self.log_since_start().rstrip()
        said = list(re.finditer(r"^dynabatch [a-z]+: ", text, re.M))
        if said:
            return text[said[-1].start() :]
        if no_space_left(self.log_path):
            return f"no space left on device (its log {self.log_path} is on the full file system)"
        return (text.splitlines() or [""])[-1]

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def _wait_exit(proc: Process, timeout_s: float) -> None:
    """Return once `proc` has exited or `timeout_s` has passed."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Launcher:
    """A job's child processes on 127.0.0.1, their logs in `log_dir`.

    `curve_dirs` maps a role (an evaluator's apart from a worker's) to the `--curve-dir` it gets (see
    `shared_keys` and `keys_per_role`); without an entry a role runs without
    CURVE. `prefix` goes before every child's name, so that several launchers can
    share one log folder. `preloader_socket`: a listening preloader (`dynabatch preload`) to fork shards and
    workers from, which the launcher leaves running; none (or none there): one of its own, ended with it.
    """

    log_dir: Path
    curve_dirs: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    children: list[Child] = field(default_factory=list)
    preloader_socket: str = ""

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.scheduler_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.preloaded = Preloaded(self.log_dir / f"{self.prefix}preloader.log", self.preloader_socket)

    def _process(self, cmd: list[str], log_path: Path, pipe_stdout: bool) -> Process:
        """A shard or worker (`dynabatch ps|worker` run by this interpreter) forked by the preloading process
        (cluster/preloaded.py), sparing it torch's import; any other command started afresh."""
        if (
            PRELOADING
            and not pipe_stdout
            and cmd[:3] == command_line("")[:3]
            and len(cmd) > 3
            and cmd[3] in PRELOADED_ROLES
        ):
            return self.preloaded.spawn(cmd[3:], log_path, child_env())
        return _popen(cmd, log_path, pipe_stdout)

    def spawn(
        self,
        name: str,
        role: str,
        cmd: list[str],
        pipe_stdout: bool = False,
        serves_metrics: bool = False,
        endpoint: str = "",
    ) -> Child:
        """Start any command with its output (stderr only, with `pipe_stdout`) in log_dir/PREFIX+NAME.log."""
        name = self.prefix + name
        log_path = self.log_dir / f"{name}.log"
        start = _log_size(log_path)
        child = Child(
            role,
            name,
            self._process(cmd, log_path, pipe_stdout),
            log_path,
            cmd,
            serves_metrics=serves_metrics,
            endpoint=endpoint,
            log_start=start,
        )
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start `child`'s command again, in its place: same flags, ports and log file (appended to).

        A shard comes back on its endpoint (workers reconnect to it) and resumes
        from its checkpoint; the scheduler on its endpoint resumes from its saved
        progress (--state-dir); a worker joins again as a new member.
        """
        return self._again(
            child,
            f"exited with {child.proc.returncode}; restarted by the launcher",
            child.cmd,
            restarts=child.restarts + 1,
        )

    def again(self, child: Child) -> Child:
        """Start `child`'s command again in its place without counting a restart: it ended with the preloading
        process it was forked from (`preloader_end`), a failure that is not its own."""
        return self._again(child, "ended with its preloading process; started again by the launcher", child.cmd)

    @staticmethod
    def preloader_end(child: Child) -> int:
        """Which end of a preloading process `child` went with, counted in this run (0: it ended on its own, or
        was never forked)."""
        return child.proc.preloader_end if isinstance(child.proc, ForkedProcess) else 0

    def rebind(self, child: Child) -> Child:
        """Start `child` again on a fresh port, for a child whose port was taken before it could bind
        (`Child.port_taken`): its endpoint was not given to anyone yet, so it may still move. Not a restart."""
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        cmd = list(child.cmd)
        cmd[cmd.index("--bind") + 1] = endpoint
        if child.endpoint == self.scheduler_endpoint:
            self.scheduler_endpoint = endpoint
        return self._again(
            child,
            f"{child.endpoint} was taken before it could bind; started on {endpoint}",
            cmd,
            rebinds=child.rebinds + 1,
            endpoint=endpoint,
        )

    def _again(self, child: Child, why: str, cmd: list[str], **changes: Any) -> Child:
        with open(child.log_path, "ab") as log_file:
            log_file.write(f"--- {why} ---\n".encode())
        start = _log_size(child.log_path)
        again = replace(
            child,
            proc=self._process(cmd, child.log_path, False),
            cmd=cmd,
            log_start=start,
            _metrics_port=None,
            **changes,
        )
        self.children[self.children.index(child)] = again
        return again

    def start(
        self,
        command: str,
        name: str,
        flags: Sequence[str],
        role: str = "",
        python_args: Sequence[str] = (),
        endpoint: str = "",
    ) -> Child:
        """Start `dynabatch COMMAND FLAGS` as ROLE (default: the command), serving /metrics on a free port
        it binds itself (port 0) and announces in its log."""
        cmd = command_line(
            command,
            [
                *flags,
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                "0",
                "--curve-dir",
                self.curve_dirs.get(role or command, ""),
            ],
            python_args,
        )
        return self.spawn(name, role or command, cmd, serves_metrics=True, endpoint=endpoint)

    def start_scheduler(self, flags: Sequence[str]) -> Child:
        """The scheduler at `scheduler_endpoint`; it stays up after the job ends, until it is stopped.

        Returns once it listens (or has exited, or BIND_WAIT_S passed), since every process
        started after it is told this endpoint: one whose port was taken before it could bind
        is started on another, and `scheduler_endpoint` follows it, before anyone is told.
        """
        child = self.start(
            "scheduler",
            "scheduler",
            ["--bind", self.scheduler_endpoint, "--no-exit-on-finish", *flags],
            endpoint=self.scheduler_endpoint,
        )
        deadline = time.monotonic() + BIND_WAIT_S
        while not child.listening() and time.monotonic() < deadline:
            if child.port_taken() and child.rebinds < BIND_ATTEMPTS:
                child = self.rebind(child)
            elif not child.alive():
                break  # exited for another reason: the caller sees it exit, its log says why
            _wait_exit(child.proc, POLL_S)
        return child

    def start_shard(
        self, index: int, name: str, flags: Sequence[str] = (), port: int | None = None, python_args: Sequence[str] = ()
    ) -> Child:
        """Shard `index` bound to `port` (a free one by default: a restarted shard passes its old one)."""
        endpoint = f"tcp://127.0.0.1:{port or free_port()}"
        return self.start(
            "ps",
            name,
            ["--scheduler", self.scheduler_endpoint, "--bind", endpoint, "--shard-index", str(index), *flags],
            python_args=python_args,
            endpoint=endpoint,
        )

    def start_worker(self, name: str, flags: Sequence[str] = (), evaluator: bool = False) -> Child:
        return self.start(
            "worker",
            name,
            ["--scheduler", self.scheduler_endpoint, "--name", name, *flags, *(["--evaluator"] if evaluator else [])],
            "evaluator" if evaluator else "worker",
        )

    def movable(self, child: Child) -> bool:
        """A shard whose port was taken at its first start may start on another (BIND_ATTEMPTS times): it
        registers its endpoint only once bound, so no one knows the old one. The scheduler never moves
        here: its endpoint went to every process, so `start_scheduler` settles it before that."""
        return child.role == "ps" and child.rebinds < BIND_ATTEMPTS and child.port_taken()

    def failed(self, role: str = "") -> list[Child]:
        """Children (of `role`, or every one) that exited with an error."""
        return [c for c in self.children if role in ("", c.role) and c.proc.poll() not in (None, 0)]

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

    def kill_all(self) -> None:
        """SIGKILL every running child's session (the child and anything it started), without waiting:
        the forced stop, safe to call from a signal handler."""
        for c in self.children:
            if c.proc.returncode is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # already gone (a zombie not yet reaped holds its id; a forked child's preloader reaps it
                    # at once, and its pid could be another's only after a wrap-around of pids before the report)
        self.preloaded.kill()

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every child, role by role in STOP_ORDER; other children (a benchmark's drivers) go first."""
        others = [role for role in dict.fromkeys(c.role for c in self.children) if role not in STOP_ORDER]
        for role in (*others, *STOP_ORDER):
            self.stop(role, timeout_s)
        self.preloaded.close()

    def write_targets(self, job: str, path: Path) -> Path:
        """A Prometheus file_sd list of every child's /metrics announced so far, labelled by role and name.

        Called again as children start, restart (on a new port) and announce, it rewrites the
        file only when the list changed, by rename, so Prometheus never reads half a file.
        `job` is the job's name, as in Kubernetes, where the monitors take Prometheus'
        `job` label from the dynabatch.io/job pod label: the dashboard selects by it.
        """
        targets = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"job": job, "role": c.role, "name": c.name}}
            for c in self.children
            if (port := c.announced_metrics_port())
        ]
        text = json.dumps(targets, indent=2)
        if not path.exists() or path.read_text() != text:
            write_text_atomic(path, text)
        return path
