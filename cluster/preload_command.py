"""`dynabatch preload SOCKET`: one process that imports torch once and forks the shards and workers of every
`dynabatch run` started with `--preloader SOCKET` (or DYNABATCH_PRELOADER=SOCKET) while it runs.

A job forks its roles from a preloader of its own, which costs it torch's import
(about 2 s of CPU) before its first step: in a sweep of short jobs, or a test
suite, a large part of each job. This preloader serves any number of jobs, one
after another or at once, as the user who started it (no one else may connect).
Each job's processes are its own as before: their command lines, sessions, logs,
environment and folder; when a job's `dynabatch run` ends, however it ends, its
processes get SIGTERM. Ctrl-C or SIGTERM ends the preloader and, with it, every
process it forked.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dynabatch.cluster.preloaded import SUPPORTED, preload, run_forked, stops_held
from dynabatch.common.flags import ConfigError, FlagParser


@dataclass(frozen=True)
class Listening:
    """The preloader's socket and the file it is bound to (its inode: the file another preloader may have put in
    its place since is not removed)."""

    sock: socket.socket
    path: Path
    inode: int

    def close(self) -> None:
        self.sock.close()
        try:
            if self.path.lstat().st_ino == self.inode:
                self.path.unlink()
        except OSError:
            pass  # gone already


def listen(path: Path) -> Listening:
    """A Unix socket listening at `path`, readable and writable by this user alone; one a preloader that ended
    left behind is replaced, a live preloader's or any other file is refused. It is bound and listening under a
    name of its own, then renamed to `path`: a launcher that finds it there can connect."""
    if not path.parent.is_dir():
        raise ConfigError(f"{path}: its folder {path.parent} does not exist")
    try:
        if path.exists() or path.is_symlink():
            _stale(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staged = path.with_name(f".{path.name}.{os.getpid()}")
        old = os.umask(0o177)
        try:
            listener.bind(str(staged))
            listener.listen(64)
            listener.setblocking(False)
            os.replace(staged, path)
            inode = path.lstat().st_ino
        except OSError:
            listener.close()
            staged.unlink(missing_ok=True)
            raise
        finally:
            os.umask(old)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    return Listening(listener, path, inode)


def _stale(path: Path) -> None:
    """Remove the socket at `path` if no preloader answers there (one that was killed left it); refuse anything
    else."""
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ConfigError(f"{path} is a file, not a socket: name a path to make the socket at")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        raise ConfigError(f"{path}: a preloader already listens there")
    except ConnectionRefusedError:
        path.unlink()
    finally:
        probe.close()


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str]) -> int:
    parser = FlagParser("dynabatch preload", __doc__)
    parser.add_argument("socket", metavar="SOCKET", type=Path, help="the path of the socket to listen at")
    args = parser.parse_args(argv)
    if not SUPPORTED:
        parser.error("a preloader forks after torch's import, which needs Linux")
    preloader = os.getpid()
    signal.signal(signal.SIGTERM, _stop)
    listener = None
    try:
        try:
            listener = listen(args.socket)
        except ConfigError as exc:
            parser.error(str(exc))
        print(
            f"dynabatch preload: listening at {args.socket} (pid {preloader}); "
            f"start jobs with --preloader {args.socket} or DYNABATCH_PRELOADER={args.socket}",
            flush=True,
        )
        # A stop raised inside torch's import can be swallowed there (torch's C++ side imports numpy and carries on
        # when that fails), and the preloader would serve on after it was told to end: held, it is acted on here.
        with stops_held():
            preload()
        return run_forked(None, listener.sock)
    except KeyboardInterrupt:
        if os.getpid() != preloader:  # a forked child's own, which it raises as a fresh process would
            raise
        return 0
    finally:
        if os.getpid() == preloader and listener is not None:  # a forked child returns through here too
            listener.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
