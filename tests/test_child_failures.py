"""Port races and child deaths under the launcher and `dynabatch run`, with real processes.

A port another process takes between the launcher's choice and the child's bind must
not fail a run (two test suites on one machine did that), and a worker that dies
while the job runs must not leave `dynabatch run` waiting for its timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dynabatch.cluster.launcher import command_line
from dynabatch.cluster.main import JobRun
from dynabatch.cluster.options import RunOptions
from dynabatch.cluster.restart_policy import after_exit
from dynabatch.common.config import JobConfig
from dynabatch.common.net.metrics import announced_port
from dynabatch.common.wire.messages import JobStatus
from harness import alone_env, free_port, interrupt, status_at, wait_for
from processes import descendants

STATUS_S = 0.2  # the run's loop period: how soon it can notice an exit
STATUS_TIMEOUT_S = 2.0  # the run's STATUS request timeout, the longest one turn of its loop can block


@pytest.mark.parametrize(
    "role, restarts, port_taken, goes_on, action",
    [
        ("ps", 0, True, False, "rebind"),
        ("worker", 1, False, True, "restart"),
        ("scheduler", 2, False, True, "restart"),
        ("worker", 3, False, True, "leave_out"),
        ("worker", 3, False, False, "fail"),
        ("evaluator", 3, False, True, "fail"),
        ("ps", 3, False, True, "fail"),
    ],
)
def test_after_exit_restarts_a_bounded_number_of_times_then_leaves_out_only_a_worker(
    role: str, restarts: int, port_taken: bool, goes_on: bool, action: str
) -> None:
    assert after_exit(role, restarts, 3, port_taken, goes_on) == action


def test_a_child_that_ended_with_its_preloader_is_started_again_uncounted_while_the_preloader_may_end() -> None:
    """The preloader's failure is not the child's: up to --restarts of the preloader's ends, its children come back
    without spending their own restarts; past them a preloader that keeps dying counts as their deaths."""
    assert after_exit("ps", 3, 3, False, False, preloader_ends=1) == "again", "even past its own restarts"
    assert after_exit("worker", 0, 3, False, True, preloader_ends=3) == "again"
    assert after_exit("ps", 3, 3, False, False, preloader_ends=4) == "fail"
    assert after_exit("worker", 0, 3, False, True, preloader_ends=4) == "restart"
    assert after_exit("ps", 0, 3, True, False, preloader_ends=1) == "rebind", "a taken port is moved first"


@pytest.mark.parametrize("role", ["worker", "evaluator", "ps", "scheduler"])
def test_a_process_that_exits_2_is_never_restarted_whatever_its_role(role: str) -> None:
    assert after_exit(role, 0, 3, False, True, returncode=2) == "refused"
    assert after_exit(role, 0, 3, False, True, returncode=1) == "restart"


def _occupied() -> socket.socket:
    """A listening socket on a port the launcher would pick, as another job's process holds it."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.slow
def test_a_scheduler_and_a_shard_whose_ports_are_taken_start_on_others_and_metrics_ports_are_announced(
    tmp_path: Path,
) -> None:
    run = JobRun(RunOptions(restarts=0), JobConfig(), [], tmp_path, "", None)
    ln = run.launcher
    taken = _occupied()
    held = taken.getsockname()[1]
    ln.scheduler_endpoint = f"tcp://127.0.0.1:{held}"
    try:
        scheduler = ln.start_scheduler(["--dataset", "synthetic", "--model", "mlp"])
        assert scheduler.listening() and _port(ln.scheduler_endpoint) != held, scheduler.log_text()
        assert f"127.0.0.1:{held} was taken before it could bind" in scheduler.log_text()

        shard_port = _occupied()
        shard = ln.start_shard(0, "ps0", port=shard_port.getsockname()[1])
        wait_for("the shard to exit on its taken port", lambda: ln.failed("ps"), 60)
        assert ln.movable(ln.failed("ps")[0])
        assert run._supervise(), "a start on a taken port is moved, not counted against --restarts 0"
        shard = ln.children[-1]
        assert shard.restarts == 0 and shard.rebinds == 1 and _port(shard.endpoint) != shard_port.getsockname()[1]
        st = wait_for(
            "the moved shard registered",
            lambda: s if (s := status_at(zmq.Context.instance(), ln.scheduler_endpoint)) and s.shards else None,
            60,
        )
        assert st.shards["0"].endpoint == shard.endpoint
        assert st.shards["0"].metrics_url == f"http://127.0.0.1:{shard.metrics_port}/metrics"

        for child in (scheduler, shard):
            assert "dynabatch_bad_messages_total" in child.metrics(), child.name
        targets = json.loads(ln.write_targets("dynabatch", tmp_path / "targets.json").read_text())
        assert {t["labels"]["name"]: t["targets"] for t in targets} == {
            "scheduler": [f"127.0.0.1:{scheduler.metrics_port}"],
            "ps0": [f"127.0.0.1:{shard.metrics_port}"],
        }
        shard_port.close()
    finally:
        taken.close()
        ln.stop_all()


def test_a_worker_that_keeps_dying_at_start_fails_the_run_with_its_log_once_restarts_are_spent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the job trains, the others wait for it (--min-workers 2): the run ends instead of waiting."""
    run = JobRun(RunOptions(restarts=1), JobConfig(min_workers=2), [], tmp_path, "", None)
    run.launcher.spawn("worker0", "worker", [sys.executable, "-c", "import time; time.sleep(60)"])
    run.launcher.spawn("worker1", "worker", [sys.executable, "-c", "import sys; sys.exit('worker1: bad flag')"])
    try:
        wait_for("worker1 to exit", lambda: run.launcher.failed("worker"), 30)
        assert run._supervise()
        wait_for("worker1 to exit again", lambda: run.launcher.failed("worker"), 30)
        assert not run._supervise(), "its restarts are spent and the job cannot start without it"
        err = capsys.readouterr().err
        assert "worker1 exited with code 1; starting it again (1 of 1)" in err
        assert "worker1 exited with code 1 after 1 restart(s) (--restarts 1); the run fails; its log ends:\n" in err
        assert err.rstrip().endswith("worker1: bad flag"), err
        run._report(1.0)
        failed = "worker1 exited with code 1 after 1 restart(s) (--restarts 1); the run fails"
        assert json.loads((tmp_path / "summary.json").read_text())["failed"] == failed, "the run folder says why"
        assert f"FAILED: {failed}" in capsys.readouterr().out

        run.job = JobConfig(min_workers=1)
        assert run._supervise() and run._supervise(), "with enough workers the job goes on without it"
        err = capsys.readouterr().err
        assert err.count("the job goes on without it") == 1, "said once, then left out"
    finally:
        run.launcher.stop_all()


def test_a_worker_that_exits_2_ends_the_run_at_once_with_its_one_line_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration error found only by the worker: no restart (--restarts 3), exit 2, the line it said."""
    run = JobRun(RunOptions(restarts=3), JobConfig(), [], tmp_path, "", None)
    say = (
        "import sys; print('INFO loading', file=sys.stderr); "
        "print('dynabatch worker: a/train-images: truncated', file=sys.stderr); sys.exit(2)"
    )
    run.launcher.spawn("worker0", "worker", [sys.executable, "-c", say])
    try:
        wait_for("worker0 to exit", lambda: run.launcher.failed("worker"), 30)
        assert not run._supervise(), "the run ends at once"
        assert run.launcher.children[0].restarts == 0 and run.refused
        assert capsys.readouterr().err == (
            "worker0 exited with code 2, not restarted: dynabatch worker: a/train-images: truncated\n"
        )
    finally:
        run.launcher.stop_all()


def _argv(pid: int) -> bytes:
    """`pid`'s command line, its arguments apart by spaces (b"": gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _children_of(pid: int, name: str) -> list[int]:
    """Processes below `pid` (its children, or the preloader's: cluster/preloaded.py) whose command line has
    `--name NAME`."""
    found = []
    for child in descendants(pid):
        argv = _argv(child).split()  # a forked role's: one string
        if b"--name" in argv and argv[argv.index(b"--name") + 1] == name.encode():
            found.append(child)
    return found


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_started_again_and_trains_and_the_targets_follow_it(tmp_path: Path) -> None:
    """A fixed-batch job, as the one that hung: the killed worker must train again within twice the time the
    run took to get both workers training, plus a few of their steps and one turn of the run's loop. Then its
    preloader is killed, taking the shard and both workers with it: they come back too, the worker though its one
    restart (`--restarts 1`) is spent (the preloader's death is not theirs)."""
    started = time.monotonic()
    err_path = tmp_path / "run.err"
    with open(err_path, "wb") as err:
        run = subprocess.Popen(
            command_line(
                "run",
                [
                    "--out",
                    str(tmp_path),
                    "--name",
                    "r",
                    "--dataset",
                    "synthetic",
                    "--model",
                    "mlp",
                    "--epochs",
                    "1000",
                    "--workers",
                    "2",
                    "--slowdowns",
                    "1",
                    "--no-evaluator",
                    "--protocol",
                    "asgd",
                    "--batch-policy",
                    "fixed",
                    "--status-s",
                    str(STATUS_S),
                    "--timeout-s",
                    "200",
                    "--restarts",
                    "1",
                    "--no-plots",
                ],
            ),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=alone_env(),  # its workers below it, where _children_of looks
        )
    logs = tmp_path / "r" / "logs"
    ctx = zmq.Context()
    try:
        found = wait_for(
            "the scheduler's endpoint",
            lambda: (
                (logs / "scheduler.log").exists()
                and re.search(r"at (tcp://[0-9.]+:\d+)", (logs / "scheduler.log").read_text())
            ),
            60,
        )
        endpoint = found.group(1)

        def training(st: JobStatus | None, names: set[str]) -> bool:
            return st is not None and names <= {w.name for w in st.workers.values() if w.steps > 0}

        def trained_anew(names: set[str], before: set[str]) -> bool:
            """Every worker of `names` has stepped under an id not in `before` (a start after a kill)."""
            st = status_at(ctx, endpoint)
            return st is not None and names <= {
                w.name for wid, w in st.workers.items() if w.steps > 0 and wid not in before
            }

        st = wait_for(
            "both workers training",
            lambda: (s := status_at(ctx, endpoint)) and training(s, {"worker0", "worker1"}) and s,
            120,
        )
        startup_s = time.monotonic() - started
        step_s = max(w.times.step_s for w in st.workers.values())
        before = {wid for wid, w in st.workers.items() if w.name == "worker1"}
        (victim,) = _children_of(run.pid, "worker1")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()

        bound_s = 2 * startup_s + 10 * step_s + STATUS_S + STATUS_TIMEOUT_S
        wait_for("worker1 training again under a new id", lambda: trained_anew({"worker1"}, before), bound_s)
        print(
            f"\nstart {startup_s:.1f}s, step {1000 * step_s:.0f} ms; kill to training again "
            f"{time.monotonic() - killed:.1f}s (bound {bound_s:.1f}s)"
        )
        assert "worker1 exited with code -9; starting it again (1 of 1)" in err_path.read_text()

        worker1_log = (logs / "worker1.log").read_text()
        assert "restarted by the launcher" in worker1_log
        port = announced_port(worker1_log)

        def listed() -> bool:
            targets = json.loads((tmp_path / "r" / "prometheus_targets.json").read_text())
            return [f"127.0.0.1:{port}"] in [t["targets"] for t in targets if t["labels"]["name"] == "worker1"]

        wait_for(
            "the targets file to list the restarted worker's new /metrics port",
            listed,
            STATUS_S + STATUS_TIMEOUT_S + bound_s,
        )

        before = set(wait_for("a status", lambda: status_at(ctx, endpoint), bound_s).workers)
        (preloader,) = [p for p in descendants(run.pid) if b"dynabatch.cluster.preloaded" in _argv(p)]
        os.kill(preloader, signal.SIGKILL)
        killed = time.monotonic()
        # Everything the run started but the scheduler starts again: a new preloader imports torch first, then
        # forks the shard (which restores its checkpoint) and both workers, one after another.
        again_s = 4 * startup_s + 10 * step_s + STATUS_S + STATUS_TIMEOUT_S
        wait_for(
            "both workers training again, under new ids, from a shard started again",
            lambda: trained_anew({"worker0", "worker1"}, before),
            again_s,
        )
        print(f"preloader killed to training again {time.monotonic() - killed:.1f}s (bound {again_s:.1f}s)")
        said = err_path.read_text()
        for name in ("ps0", "worker0", "worker1"):
            assert f"{name} ended with the preloading process it was forked from (its end 1 of 1 allowed" in said, said
        assert said.count("; starting it again (") == 1 and "the job goes on without it" not in said, said
    finally:
        interrupt(run)
        ctx.destroy(linger=0)
    assert run.returncode == 130, "interrupted (SIGINT) before its 1000 epochs"
