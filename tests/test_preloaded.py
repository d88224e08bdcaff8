"""The preloading process (cluster/preloaded.py): a forked role is the process a fresh interpreter would have been."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynabatch.cluster.launcher import Child, Launcher, child_env, command_line
from dynabatch.cluster.preloaded import SUPPORTED, Preloaded
from hang_guard import hang_guard_s
from harness import free_port, start_preload, wait_for
from processes import alive, table

# A job that trains until it is stopped: the synthetic set's MLP, one worker, nothing else the preloader forks.
FOREVER = [
    *("--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--workers", "1", "--slowdowns", "1"),
    *("--no-evaluator", "--no-plots", "--timeout-s", "200"),
]

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the preloader forks on Linux only")


def test_a_forked_worker_has_its_own_command_line_session_folder_log_and_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    preloaded = Preloaded(tmp_path / "preloader.log")
    log = tmp_path / "w.log"
    # A worker whose scheduler never answers waits for it: a process that stays up until it is signalled.
    argv = ["worker", "--scheduler", f"tcp://127.0.0.1:{free_port()}", "--name", "lonely"]
    try:
        child = preloaded.spawn(argv, log, child_env())
        assert log.exists(), "the log is there when spawn returns, as a started process's is"
        assert child.poll() is None

        def cmdline() -> list[str]:
            return Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()

        # Set right after the fork: until then it shows the preloader's.
        wait_for("its own command line", lambda: cmdline()[-6:] == ["dynabatch.cli.main", *argv], 30)
        assert os.getsid(child.pid) == child.pid, "a session of its own, as start_new_session gives"
        assert Path(f"/proc/{child.pid}/cwd").resolve() == tmp_path.resolve()
        wait_for("the worker to log that it waits for its scheduler", lambda: "scheduler" in log.read_text(), 60)
        child.send_signal(signal.SIGTERM)
        code = child.wait(hang_guard_s(60))
        assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM), code
        child.send_signal(signal.SIGTERM)  # a finished process: nothing happens, as with Popen

        refused = preloaded.spawn(["ps", "--shard-index", "-2"], tmp_path / "bad.log", child_env())
        assert refused.wait(hang_guard_s(60)) == 2, (tmp_path / "bad.log").read_text()
        assert "dynabatch ps:" in (tmp_path / "bad.log").read_text(), "its one-line refusal, in its own log"
    finally:
        preloaded.close()
    assert preloaded.gone or preloaded.pid == -1 or not Path(f"/proc/{preloaded.pid}").exists()


def test_children_of_a_killed_preloader_end_and_are_seen_to(tmp_path: Path) -> None:
    preloaded = Preloaded(tmp_path / "preloader.log")
    argv = ["worker", "--scheduler", f"tcp://127.0.0.1:{free_port()}", "--name", "orphan"]
    child = preloaded.spawn(argv, tmp_path / "w.log", child_env())
    wait_for("the worker to start", lambda: "scheduler" in (tmp_path / "w.log").read_text(), 60)
    preloaded.kill()
    wait_for("the preloader to die", lambda: not alive({preloaded.pid}), 30)  # kill() does not wait
    # A restarted child comes from a new preloader; the old one's child still learns of its end (from its pidfd).
    again = preloaded.spawn(["ps", "--shard-index", "-2"], tmp_path / "bad.log", child_env())
    assert child.wait(hang_guard_s(60)) is not None, "the parent-death signal ends it, and its handle sees that"
    child.kill()  # its pid may be anyone's now: the pidfd keeps the signal from reaching them
    assert again.wait(hang_guard_s(60)) == 2
    preloaded.close()


@pytest.fixture
def short_folder() -> Iterator[Path]:
    """A folder for sockets: a Unix socket's path is at most 107 bytes, which pytest's tmp_path can pass."""
    folder = Path(tempfile.mkdtemp(prefix="dynabatch-preload-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _listening(sock: Path) -> subprocess.Popen[str]:
    """`dynabatch preload SOCK`, what it prints read at its end."""
    return start_preload(sock, subprocess.PIPE)


def _stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM a `dynabatch preload` and wait: what it printed."""
    proc.terminate()
    return proc.communicate(timeout=hang_guard_s(60))[0]


def _maps(pid: int, name: str) -> bool:
    """Whether process `pid` has a file named like `name` mapped (a library it has loaded)."""
    return name in Path(f"/proc/{pid}/maps").read_text()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_launchers_at_a_listening_preloader_fork_from_it_and_each_ends_only_its_own_children(
    tmp_path: Path, short_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dynabatch preload` serves every launcher that names its socket: one launcher's stop ends its own
    children, not the preloader nor another's; a `dynabatch run` killed outright has its shard and worker sent
    SIGTERM, as has a launcher whose connection ends; a launcher without a socket has a preloader of its own,
    which ends with it."""
    sock = short_folder / "p.sock"
    preload = _listening(sock)
    first, second, later = (Launcher(tmp_path / name, preloader_socket=str(sock)) for name in ("1", "2", "later"))
    own = Launcher(tmp_path / "own")
    run = None
    try:
        children = [launcher.start_worker("w") for launcher in (first, second, own)]  # no scheduler: they wait
        for child in children:

            def waits(c: Child = child) -> bool:
                return "scheduler" in c.log_text()

            wait_for(f"{child.log_path} to say it waits", waits, 60)
        parents = [_parent(c.proc.pid) for c in children]
        assert parents[0] == parents[1] == preload.pid != parents[2] == own.preloaded.pid
        first.stop_all()
        assert children[0].proc.poll() is not None and children[1].proc.poll() is None
        assert preload.poll() is None, "a launcher does not end a preloader it was lent"
        own.stop_all()
        wait_for("a launcher's own preloader to end", lambda: not alive({parents[2]}), 30)

        run = subprocess.Popen(
            command_line("run", ["--out", str(tmp_path), "--name", "r", "--preloader", str(sock), *FOREVER]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=child_env(),
        )

        def the_runs() -> set[int]:
            """The preloader's children but the second launcher's worker: the run's shard and worker."""
            forked = {p for p, st in table().items() if st.ppid == preload.pid and st.state != "Z"}
            return forked - {children[1].proc.pid}

        roles = wait_for(
            "the run's shard and worker, forked by the preloader",
            lambda: len(forked := the_runs()) == 2 and forked,
            120,
        )
        run.kill()
        run.wait(hang_guard_s(60))
        wait_for("the killed run's shard and worker to end", lambda: not alive(roles), 60)
        assert alive({children[1].proc.pid}), "another launcher's child runs on"
        second.preloaded.kill()  # its connection ends, as a killed launcher's does
        wait_for("the worker of the launcher that ended to stop", lambda: not alive({children[1].proc.pid}), 60)
        assert preload.poll() is None

        monkeypatch.chdir(tmp_path)  # not the preloader's folder: a relative path is the launcher's
        refused = later.preloaded.spawn(["ps", "--shard-index", "-2"], Path("bad.log"), child_env())
        assert refused.wait(hang_guard_s(60)) == 2 and later.preloaded.pid == preload.pid
        assert "dynabatch ps:" in (tmp_path / "bad.log").read_text()
    finally:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait()
        for launcher in (first, second, own, later):
            launcher.stop_all()
        printed = _stop(preload)
    assert preload.returncode == 0, printed
    assert f"listening at {sock}" in printed and not sock.exists(), "it removes its socket when it ends"


def test_preload_refuses_what_is_no_place_for_a_socket_and_a_garbled_request_changes_nothing(
    tmp_path: Path, short_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file, a folder that is not there and a live preloader's socket are refused in one line; a client that
    sends what is not a request is told nothing and the preloader serves the next; a socket its preloader left
    behind (killed outright) is one a launcher does without, and another preloader takes over; `dynabatch run
    --preloader` names a socket or is refused."""
    a_file = short_folder / "file"
    a_file.write_text("not a socket")
    sock = short_folder / "p.sock"
    for path, reason in (
        (a_file, "is a file, not a socket"),
        (short_folder / "missing" / "p.sock", "does not exist"),
    ):
        done = subprocess.run(command_line("preload", [str(path)]), capture_output=True, text=True, env=child_env())
        assert done.returncode == 2 and reason in done.stderr, done.stderr
    run = subprocess.run(
        command_line("run", ["--out", str(tmp_path), "--preloader", str(a_file)]),
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert run.returncode == 2 and "--preloader" in run.stderr and not any(tmp_path.iterdir()), run.stderr
    preload = _listening(sock)
    again = None
    try:
        twice = subprocess.run(command_line("preload", [str(sock)]), capture_output=True, text=True, env=child_env())
        assert twice.returncode == 2 and "already listens" in twice.stderr, twice.stderr
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as garbled:
            garbled.connect(str(sock))
            garbled.sendall(b'not json\n{"argv": 3, "log": "x", "env": {}, "cwd": "/"}\n')
            launcher = Launcher(tmp_path / "after", preloader_socket=str(sock))
            refused = launcher.preloaded.spawn(["ps", "--shard-index", "-2"], tmp_path / "bad.log", child_env())
            assert refused.wait(hang_guard_s(60)) == 2
            launcher.stop_all()
        preload.kill()
        preload.wait(hang_guard_s(60))
        assert sock.is_socket(), "killed outright, it leaves its socket"
        stale = Launcher(tmp_path / "stale", preloader_socket=str(sock))
        for log in ("alone.log", "alone-again.log"):
            alone = stale.preloaded.spawn(["ps", "--shard-index", "-2"], tmp_path / log, child_env())
            assert alone.wait(hang_guard_s(60)) == 2 and stale.preloaded.pid not in (preload.pid, -1)
        stale.stop_all()
        assert capsys.readouterr().err.count(f"no preloader at {sock}") == 1, "said once; the job goes on without it"
        again = _listening(sock)
    finally:
        preload.kill()
        printed = preload.communicate(timeout=hang_guard_s(60))[0]
        if again is not None:
            _stop(again)
    assert printed.count("refused a request that is not one") == 2, printed
    assert not sock.exists(), "the preloader that took the stale socket over removed it when it ended"


def test_a_preloader_told_to_stop_while_it_imports_torch_stops(short_folder: Path) -> None:
    """SIGTERM (or Ctrl-C) during the preloader's start-up ends it, as it does later: raised inside torch's own
    import of numpy, the stop was swallowed there, and the preloader served on (it held a test session 30 s).
    Each stop lands at a point of the import read off the process's own mappings: as numpy's core loads, and as
    torch's Python bindings do."""
    for marker in ("_multiarray_umath", "libtorch_python"):
        sock = short_folder / f"{marker}.sock"
        preload = _listening(sock)
        try:
            wait_for(f"{marker} in the preloader's mappings", functools.partial(_maps, preload.pid, marker))
            printed = _stop(preload)
        finally:
            preload.kill()
        assert preload.returncode == 0, printed
        assert not sock.exists(), f"stopped as {marker} loaded, it removes its socket"
