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
launcher's environment and working folder, SIGTERM when its launcher ends, the
default signal handlers, Python's random state re-seeded (numpy's too), and a
normal interpreter exit (atexit handlers, threads joined).

A preloader may also outlive its launchers and serve many (`dynabatch preload
SOCKET`, then `dynabatch run --preloader SOCKET`): a sweep
of short jobs, or a test suite, pays torch's import once rather than once per job.
Each launcher is one connection; when it ends (however it ends), the preloader
sends SIGTERM to the children it forked for it, as their parent-death signal
does for a preloader of the job's own.

The preloader never runs a tensor operation, opens no socket but its launchers' and starts no
thread, so nothing a fork cannot copy exists when it forks (torch's thread pools
start at a process's first operation). It reports each child's exit code to the
launcher that asked for it, which is not the child's parent: `ForkedProcess` is the launcher's
handle, with the part of `subprocess.Popen`'s interface the launcher and tests
use. Only Linux (fork after torch's import, the parent-death signal, a peer's credentials).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        self.preloader_end = 0  # it ended with its preloader, whose end in the launcher's count this was (`poll`)
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
            self.preloader_end = max(1, self._preloaded.ends)
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


def _end(pid: int, parent: int) -> None:
    """SIGTERM to `pid` if it is still `parent`'s child: a fork nobody holds a handle to."""
    if (fd := _pidfd_of_child(pid, parent)) is not None:
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


@dataclass
class Preloaded:
    """A launcher's preloading process: the one at `socket_path` (a listening `dynabatch preload`) if it answers
    and runs as this user, else one of its own, started on the first `spawn` and ended by `close` (or with the
    launcher, by the parent-death signal). Each exit it reports goes to the child's handle; a pid is freed only
    once its exit was reported, so the reports, read in order, never confuse two children that had the same
    pid."""

    log_path: Path
    socket_path: str = ""
    forked: dict[int, ForkedProcess] = field(default_factory=dict)  # running children by pid
    exited: dict[int, int] = field(default_factory=dict)  # exit codes of children that ended before their handle
    _proc: subprocess.Popen[bytes] | None = None  # a preloader of its own
    _conn: socket.socket | None = None  # to the preloader: requests out, reports in
    _peer: int = -1  # the preloader's pid
    _lines: bytes = b""
    _started: int | None = None  # the pid of the last fork reported and not yet handed out
    _abandoned: int = 0  # requests whose fork was given up on (`spawn`'s wait ran out): ended when reported
    gone: bool = False  # the preloader ended (or let this launcher go) and everything it reported was read
    ends: int = 0  # how often a preloader ended under this launcher before being let go (killed, crashed)

    def spawn(self, argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        """Fork `dynabatch ARGV` (argv[0] is the command) with its output appended to `log_path`."""
        conn = self._connected(env)
        log_path.touch()  # there before the call returns, as a started process's log file is
        request = {"argv": argv, "log": str(log_path), "env": env, "cwd": os.getcwd()}
        try:
            conn.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            raise RuntimeError(f"the preloading process exited; its log ends:\n{self._tail()}") from None
        deadline = time.monotonic() + START_WAIT_S
        while (pid := self._started) is None:
            left = deadline - time.monotonic()
            if left <= 0 or (not self.collect(min(1.0, left)) and self.gone):
                self._abandoned += 1  # a late report of this fork is not the next request's
                raise RuntimeError(f"the preloading process did not fork {argv[0]}; its log ends:\n{self._tail()}")
        self._started = None
        return ForkedProcess(pid, argv, self)

    def _connected(self, env: dict[str, str]) -> socket.socket:
        """The connection to a preloading process, made again (with the children's environment) if there is
        none or it ended; the children of one that ended keep their handles, which then learn of their exit
        from their pidfds."""
        while self.collect(0.0):  # what it reported before it ended, and its end
            pass
        if self._conn is None or self.gone:
            if self._conn is not None:
                self._conn.close()
            for child in self.forked.values():
                child.lost = True
            self.forked.clear()
            self._lines, self.gone, self._started, self._abandoned = b"", False, None, 0
            self._conn = self._attach() or self._own(env)
        return self._conn

    def _attach(self) -> socket.socket | None:
        """A connection to the listening preloader at `socket_path` (None, said once, where there is none)."""
        if not self.socket_path:
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            self._peer, uid = peer_ids(conn)
            if uid != os.getuid():
                raise PermissionError(f"it runs as uid {uid}, not {os.getuid()}")
        except OSError as exc:
            conn.close()
            print(
                f"dynabatch: no preloader at {self.socket_path} ({exc.strerror or exc}); "
                "this job imports torch in a preloader of its own",
                file=sys.stderr,
            )
            self.socket_path = ""
            return None
        return conn

    def _own(self, env: dict[str, str]) -> socket.socket:
        """A preloading process of this launcher's own, reading requests from and writing reports to one end of
        a socket pair as its stdin and stdout."""
        ours, theirs = socket.socketpair()
        with theirs, open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dynabatch.cluster.preloaded"],
                stdin=theirs.fileno(),
                stdout=theirs.fileno(),
                stderr=log,
                start_new_session=True,
                env=env,
                preexec_fn=die_with_parent(),
            )
        self._peer = self._proc.pid
        return ours

    @property
    def pid(self) -> int:
        return self._peer

    def collect(self, timeout_s: float) -> bool:
        """Read what the preloader reported within `timeout_s`: True if anything came."""
        conn = self._conn
        if conn is None:
            return False
        if self.gone:  # nothing more will come (a caller polling its children waits a little)
            time.sleep(max(0.0, min(timeout_s, 0.02)))
            return False
        if not select.select([conn], [], [], max(0.0, timeout_s))[0]:
            return False
        try:
            data = conn.recv(65536)
        except ConnectionError:
            data = b""
        if not data:  # the preloader is gone (its children got SIGTERM with it), all it reported read
            self.gone = True
            self.ends += 1
            if self._proc is not None and self._proc.pid == self._peer:
                self._proc.wait()
            return False
        self._lines += data
        *lines, self._lines = self._lines.split(b"\n")
        for line in lines:
            kind, pid, *code = line.decode().split()
            if kind == "started" and self._abandoned:
                self._abandoned -= 1
                _end(int(pid), self._peer)
            elif kind == "started":
                self._started = int(pid)
            elif (child := self.forked.pop(int(pid), None)) is not None:
                child.exited(int(code[0]))
            else:
                self.exited[int(pid)] = int(code[0])
        return True

    def _tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:]) if self.log_path.exists() else ""

    def close(self) -> None:
        """Let the preloading process go (its children have been stopped): one of its own ends, a listening one
        forgets this launcher."""
        if self._conn is None:
            return
        if self._proc is not None and self._proc.pid == self._peer and self._proc.poll() is None:
            self._conn.shutdown(socket.SHUT_WR)  # its end of the requests: it exits
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._conn.close()
        self._conn, self.gone = None, True

    def kill(self) -> None:
        """End every child at once, without waiting (safe from a signal handler): SIGKILL to a preloader of its
        own (its children get their parent-death signal); a listening one is told this launcher ended."""
        if self._proc is not None and self._proc.pid == self._peer and self._proc.returncode is None:
            try:
                os.kill(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self._conn is not None:
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# -- the preloading process -------------------------------------------------------------------


@dataclass
class _Client:
    """One launcher's connection, as the preloader sees it: its requests not yet read whole, and the children
    forked for it that have not been reaped."""

    conn: socket.socket
    pending: bytes = b""
    children: set[int] = field(default_factory=set)
    stuck: bool = False  # it let its reports fill the socket: dropped, lest it hold up every other launcher

    def report(self, line: str) -> None:
        try:
            self.conn.sendall(line.encode() + b"\n")
        except BlockingIOError:
            self.stuck = True
        except OSError:
            pass  # it is gone: its end is read as such on the next turn


def _serve(first: socket.socket | None, listener: socket.socket | None) -> dict[str, Any] | None:
    """Fork a child per request line of each launcher (`first`, and whoever connects to `listener`); report
    "started PID" and "exited PID CODE" to the launcher that asked. Returns, in a child, its request; in a
    preloader without a listener, None once its one launcher closed its end. A launcher that ends under a
    listening preloader, or leaves so many reports unread that they would block the preloader, has its
    children still running sent SIGTERM."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    launchers = {first.fileno(): _Client(first)} if first is not None else {}
    owners: dict[int, _Client] = {}  # each unreaped child's launcher
    while True:
        listening = [listener] if listener is not None else []
        ready: list[int] = select.select([wake_r, *(each.fileno() for each in listening), *launchers], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(owners)
        for each in listening:
            if each.fileno() in ready:
                _accept(each, launchers)
        for fd in ready:
            if (launcher := launchers.get(fd)) is None:
                continue
            try:
                data = launcher.conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionError:
                data = b""
            if not data:
                launcher.stuck = True  # ended: dropped as one that is stuck
                continue
            launcher.pending += data
            *lines, launcher.pending = launcher.pending.split(b"\n")
            for line in lines:
                if (request := _request(line)) is None:
                    print(f"dynabatch preload: refused a request that is not one: {line[:200]!r}", file=sys.stderr)
                    continue
                if (pid := _fork()) == 0:
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    for other in (*listening, *(each.conn for each in launchers.values())):
                        other.close()
                    return request
                launcher.children.add(pid)
                owners[pid] = launcher
                launcher.report(f"started {pid}")
        for fd, launcher in [(fd, each) for fd, each in launchers.items() if each.stuck]:
            del launchers[fd]
            launcher.conn.close()
            if listener is None:
                return None
            for pid in launcher.children:  # unreaped, so the pid is still this child's
                os.kill(pid, signal.SIGTERM)


@contextmanager
def stops_held() -> Iterator[None]:
    """SIGTERM and SIGINT blocked within, and delivered when it ends if either came meanwhile: a stop is acted on
    where the code after it runs, not wherever it happened to land. Threads started within inherit the block."""
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def _fork() -> int:
    """os.fork, the child with the default SIGTERM and SIGINT before either can reach it: the preloader's own
    handlers (`dynabatch preload` exits on them) are not the child's."""
    with stops_held():
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return pid


def _request(line: bytes) -> dict[str, Any] | None:
    """A launcher's request to fork, if the line is one (a client of a listening preloader may be anything)."""
    try:
        request = json.loads(line)
    except ValueError:
        return None
    fields = {"argv": list, "log": str, "env": dict, "cwd": str}
    if not isinstance(request, dict) or any(not isinstance(request.get(k), kind) for k, kind in fields.items()):
        return None
    return request


def _accept(listener: socket.socket, launchers: dict[int, _Client]) -> None:
    """A launcher that connected, if it runs as this user: anyone else could have this user's code run."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    pid, uid = peer_ids(conn)
    if uid != os.getuid():
        print(f"dynabatch preload: refused pid {pid}: it runs as uid {uid}, not {os.getuid()}", file=sys.stderr)
        conn.close()
        return
    conn.setblocking(False)  # a launcher that stops reading must not stop the preloader (`_Client.report`)
    launchers[conn.fileno()] = _Client(conn)


def _report_exits(owners: dict[int, _Client]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if (launcher := owners.pop(pid, None)) is not None:
            launcher.children.discard(pid)
            launcher.report(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _become(request: dict[str, Any], preloader: int) -> list[str]:
    """In the forked child: take the request's session, output, environment, folder and signals, as a fresh
    `python -m dynabatch.cli.main` would have them; returns its arguments."""
    os.setsid()
    os.chdir(request["cwd"])  # first: the log's path may be relative to it
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
    arm_parent_death(preloader)  # a launcher's own preloader dies with it; a listening one sends SIGTERM
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "dynabatch.cli.main", *request["argv"]]))
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed()  # a fresh process seeds it from the OS; every fork would share the preloader's
    return list(request["argv"])


def preload() -> None:
    """Import what the roles import."""
    import torch  # noqa: F401

    import dynabatch.cli.main
    import dynabatch.ps.main
    import dynabatch.ps.server
    import dynabatch.worker.device
    import dynabatch.worker.evaluator
    import dynabatch.worker.main
    import dynabatch.worker.role_process
    import dynabatch.worker.trainer  # noqa: F401


def run_forked(first: socket.socket | None, listener: socket.socket | None) -> int:
    """Serve until the preloader ends (0), or, in a forked child, run its `dynabatch` command (its exit code)."""
    preloader = os.getpid()
    request = _serve(first, listener)
    if request is None:
        return 0
    argv = _become(request, preloader)
    import dynabatch.cli.main

    sys.argv = [str(Path(dynabatch.cli.main.__file__)), *argv]
    return dynabatch.cli.main.main(argv)


def main() -> int:
    """A launcher's own preloading process: its one launcher at the socket that is its stdin and stdout."""
    preload()
    # A copy of the socket at fds 0 and 1, which a child closes before its log takes those: closing fd 0 itself
    # would hand the log fd 0, and then standard input would overwrite it.
    return run_forked(socket.socket(fileno=os.dup(0)), None)


if __name__ == "__main__":
    sys.exit(main())
