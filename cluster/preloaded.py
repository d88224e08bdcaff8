"""Shards and workers forked from an interpreter that has already imported torch.

Importing torch costs each process seconds of CPU before it does anything
(bench/RESULTS.md 16), and a job of one shard, three workers and an evaluator
would pay it five times: more than a short job trains, and on a busy laptop
seconds before the first step. The
launcher therefore starts one preloading process per job (`Preloaded`), which
imports torch and the roles' code once and then forks a child per request; the
child becomes `dynabatch ps ...` or `dynabatch worker ...` exactly as a fresh
interpreter would run it: its command line (as `ps` shows it; one string, where a
fresh process's arguments are separated by NULs), its own session, its log as stdout and stderr, the
launcher's environment and working folder, SIGTERM when its parent dies, the
default signal handlers, Python's random state re-seeded (numpy's too), and a
normal interpreter exit (atexit handlers, threads joined).

The preloader never runs a tensor operation, opens no socket and starts no
thread, so nothing a fork cannot copy exists when it forks (torch's thread pools
start at a process's first operation). It reports each child's exit code to the
launcher, which is not the child's parent: `ForkedProcess` is the launcher's
handle, with the part of `subprocess.Popen`'s interface the launcher and tests
use. Only Linux (fork after torch's import, the parent-death signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import setproctitle

from dynabatch.cluster.parent_death import arm_parent_death, die_with_parent

SUPPORTED = sys.platform.startswith("linux")
ROLES = ("ps", "worker")  # the commands that import torch; the scheduler never does
START_WAIT_S = 120.0  # the preloader's own start (its imports) plus a fork, on a loaded machine


class ForkedProcess:
    """A child the preloader forked, seen from the launcher: `subprocess.Popen`'s pid, returncode, poll, wait,
    send_signal and kill. Its exit code comes from the preloader, which is its parent and reaps it at once, so
    its pid may be another process's by the time the launcher hears of the exit: signals go through a pidfd
    (Linux 5.3), which names this process and no other, never through the pid."""

    def __init__(self, pid: int, args: list[str], preloaded: Preloaded) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.lost = False  # its preloader died and was replaced: its exit is known only by its pidfd
        self._preloaded = preloaded
        self._pidfd = _pidfd_of_child(pid, preloaded.pid)
        if pid in preloaded.exited:  # it ended before this handle existed
            self.exited(preloaded.exited.pop(pid))
        else:
            preloaded.forked[pid] = self

    def exited(self, code: int) -> None:
        """The preloader reported its exit (or lost it: `poll`)."""
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._preloaded.collect(0.0)
        if self.returncode is None and (self.lost or self._preloaded.gone) and not self._running():
            self._preloaded.forked.pop(self.pid, None)
            self.exited(-signal.SIGKILL)  # its code went with the preloader (killed: a forced stop)
        return self.returncode

    def _running(self) -> bool:
        return self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._preloaded.collect(0.5 if left is None else min(0.5, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # it ended since: as Popen's, a signal to a finished process does nothing

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pidfd_of_child(pid: int, parent: int) -> int | None:
    """A pidfd for `pid` if it is still `parent`'s child (None: it has exited, and its pid may be reused)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        ppid = -1
    if ppid != parent:
        os.close(fd)
        return None
    return fd


@dataclass
class Preloaded:
    """The launcher's preloading process: started on the first `spawn`, ended by `close` (or with the launcher,
    by the parent-death signal). Each exit it reports goes to the child's handle; a pid is freed only once its
    exit was reported, so the reports, read in order, never confuse two children that had the same pid."""

    log_path: Path
    forked: dict[int, ForkedProcess] = field(default_factory=dict)  # running children by pid
    exited: dict[int, int] = field(default_factory=dict)  # exit codes of children that ended before their handle
    _proc: subprocess.Popen[bytes] | None = None
    _lines: bytes = b""
    _started: int | None = None  # the pid of the last fork reported and not yet handed out
    gone: bool = False  # the preloader ended and everything it reported was read

    def spawn(self, argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        """Fork `dynabatch ARGV` (argv[0] is the command) with its output appended to `log_path`."""
        proc = self._running(env)
        log_path.touch()  # there before the call returns, as a started process's log file is
        request = {"argv": argv, "log": str(log_path), "env": env, "cwd": os.getcwd()}
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the preloading process exited; its log ends:\n{self._tail()}") from None
        deadline = time.monotonic() + START_WAIT_S
        while (pid := self._started) is None:
            left = deadline - time.monotonic()
            if left <= 0 or (not self.collect(min(1.0, left)) and proc.poll() is not None):
                raise RuntimeError(f"the preloading process did not fork {argv[0]}; its log ends:\n{self._tail()}")
        self._started = None
        return ForkedProcess(pid, argv, self)

    def start(self, env: dict[str, str]) -> None:
        """Start the preloading process now rather than at the first `spawn`: from the thread whose end its
        parent-death signal follows (a fork from a short-lived thread would die with that thread)."""
        self._running(env)

    def _running(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The preloading process, started (with the children's environment) if there is none or it ended; the
        children of one that ended keep their handles, which then learn of their exit from their pidfds."""
        if self._proc is None or self._proc.poll() is not None:
            while self._proc is not None and not self.gone:  # what it reported before it ended
                self.collect(1.0)
            for child in self.forked.values():
                child.lost = True
            self.forked.clear()
            self._lines, self.gone = b"", False
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "dynabatch.cluster.preloaded"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                    env=env,
                    preexec_fn=die_with_parent(),
                )
        return self._proc

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    def collect(self, timeout_s: float) -> bool:
        """Read what the preloader reported within `timeout_s`: True if anything came."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return False
        if self.gone:  # nothing more will come (a caller polling its children waits a little)
            time.sleep(max(0.0, min(timeout_s, 0.02)))
            return False
        fd = proc.stdout.fileno()
        if not select.select([fd], [], [], max(0.0, timeout_s))[0]:
            return False
        data = os.read(fd, 65536)
        if not data:  # the preloader is gone (its children got SIGTERM with it), all it reported read
            self.gone = True
            proc.wait()
            return False
        self._lines += data
        *lines, self._lines = self._lines.split(b"\n")
        for line in lines:
            kind, pid, *code = line.decode().split()
            if kind == "started":
                self._started = int(pid)
            elif (child := self.forked.pop(int(pid), None)) is not None:
                child.exited(int(code[0]))
            else:
                self.exited[int(pid)] = int(code[0])
        return True

    def _tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:]) if self.log_path.exists() else ""

    def close(self) -> None:
        """End the preloading process (its children have been stopped: it forks no more)."""
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def kill(self) -> None:
        """SIGKILL it, without waiting (safe from a signal handler)."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.kill(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the preloading process -------------------------------------------------------------------


def _serve(requests: IO[bytes], reports: IO[bytes]) -> dict[str, Any] | None:
    """Fork a child per request line; report "started PID" and "exited PID CODE". Returns, in a child, its
    request; in the preloader, None once the launcher closed its end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready = select.select([requests.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(reports)
        if requests.fileno() not in ready:
            continue
        data = os.read(requests.fileno(), 65536)
        if not data:
            return None
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                return dict(request)
            reports.write(f"started {pid}\n".encode())
            reports.flush()


def _report_exits(reports: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reports.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        reports.flush()


def _become(request: dict[str, Any], preloader: int) -> list[str]:
    """In the forked child: take the request's session, output, environment, folder and signals, as a fresh
    `python -m dynabatch.cli.main` would have them; returns its arguments."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    arm_parent_death(preloader)  # the preloader dies with the launcher, so this child does too
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "dynabatch.cli.main", *request["argv"]]))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed()  # a fresh process seeds it from the OS; every fork would share the preloader's
    return list(request["argv"])


def main() -> int:
    """The preloading process: import what the roles import, then fork on request."""
    import torch  # noqa: F401

    import dynabatch.cli.main
    import dynabatch.ps.main
    import dynabatch.ps.server
    import dynabatch.worker.device
    import dynabatch.worker.evaluator
    import dynabatch.worker.main
    import dynabatch.worker.role_process
    import dynabatch.worker.trainer

    preloader = os.getpid()
    request = _serve(sys.stdin.buffer, sys.stdout.buffer)
    if request is None:
        return 0
    argv = _become(request, preloader)
    sys.argv = [str(Path(dynabatch.cli.main.__file__)), *argv]
    return dynabatch.cli.main.main(argv)


if __name__ == "__main__":
    sys.exit(main())
