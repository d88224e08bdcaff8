"""The preloading process (cluster/preloaded.py): a forked role is the process a fresh interpreter would have been."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dynabatch.cluster.launcher import Child, Launcher, child_env
from dynabatch.cluster.preloaded import SUPPORTED, Preloaded
from harness import free_port, wait_for
from processes import alive

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
        code = child.wait(60)
        assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM), code
        child.send_signal(signal.SIGTERM)  # a finished process: nothing happens, as with Popen

        refused = preloaded.spawn(["ps", "--shard-index", "-2"], tmp_path / "bad.log", child_env())
        assert refused.wait(60) == 2, (tmp_path / "bad.log").read_text()
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
    assert child.wait(60) is not None, "the parent-death signal ends it, and its handle sees that"
    child.kill()  # its pid may be anyone's now: the pidfd keeps the signal from reaching them
    assert again.wait(60) == 2
    preloaded.close()


def test_launchers_that_share_a_preloader_fork_from_it_and_leave_it_running(tmp_path: Path) -> None:
    """The tests' jobs share their test process's preloader (harness.shared_preloader): one launcher's stop ends its
    own children, not the preloader nor another launcher's children; a launcher of its own ends its preloader."""
    shared = Preloaded(tmp_path / "shared.log")
    shared.start(child_env())
    first, second = (Launcher(tmp_path / name, shared_preloader=shared) for name in ("first", "second"))
    own = Launcher(tmp_path / "own")
    try:
        children = [launcher.start_worker("w") for launcher in (first, second, own)]  # no scheduler: they wait
        for child in children:

            def waits(c: Child = child) -> bool:
                return "scheduler" in c.log_text()

            wait_for(f"{child.log_path} to say it waits", waits, 60)
        parents = [int(Path(f"/proc/{c.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for c in children]
        assert parents[0] == parents[1] == shared.pid != parents[2] == own.preloaded.pid
        first.stop_all()
        assert children[0].proc.poll() is not None and children[1].proc.poll() is None
        assert alive({shared.pid}), "a launcher does not end a preloader it was lent"
        own.stop_all()
        wait_for("a launcher's own preloader to end", lambda: not alive({parents[2]}), 30)
    finally:
        for launcher in (first, second, own):
            launcher.stop_all()
        shared.close()
    assert not alive({shared.pid})
