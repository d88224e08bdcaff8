"""However `dynabatch run` ends, its children end with it, and an interrupted run still reports.

Each test starts a real run (scheduler, shard, two workers, evaluator), waits until the
evaluator has evaluated a trained model, ends the run one way, and checks the exit code,
the console, the summary, that no process of the run is left and no temporary file.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from harness import child_env, command_line, status_at, wait_for
from processes import alive, descendants, kill_sessions

pytestmark = pytest.mark.slow

ROLES = {"scheduler", "ps0", "worker0", "worker1", "evaluator"}


class Run:
    """A `dynabatch run` that trains for ever, its stderr in a file, its processes known once all started."""

    def __init__(self, tmp: Path) -> None:
        self.dir, self.err_path = tmp / "r", tmp / "run.err"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                command_line("run", ["--out", str(tmp), "--name", "r", "--dataset", "synthetic", "--model", "mlp",
                                     "--epochs", "1000", "--workers", "2", "--slowdowns", "1",
                                     "--eval-interval-s", "0.5", "--status-s", "0.2", "--timeout-s", "250"]),
                stdout=subprocess.PIPE, stderr=err, env=child_env(), text=True)
        self.children: set[int] = set()

    def trained_and_evaluated(self) -> int:
        """Wait until the evaluator has reported on a model past v0; that model's version."""
        log = self.dir / "logs" / "scheduler.log"
        found = wait_for("the scheduler's endpoint", lambda: log.exists() and re.search(
            r"at (tcp://[0-9.]+:\d+)", log.read_text()), 60)
        ctx = zmq.Context()
        try:
            st = wait_for("an evaluation of a trained model", lambda: (s := status_at(ctx, found.group(1))) and (
                s.eval_version or 0) > 0 and s, 120)
        finally:
            ctx.destroy(linger=0)
        self.children = descendants(self.proc.pid)
        assert ROLES <= {_role(pid) for pid in self.children}, self.children
        return st.eval_version

    def end(self, timeout_s: float = 120) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once the run has exited."""
        out, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out, self.err_path.read_text()

    def leftovers(self, timeout_s: float = 60) -> set[int]:
        """The run's processes still alive `timeout_s` after it ended (waiting for them to go)."""
        deadline = time.monotonic() + timeout_s
        while alive(self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive(self.children)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        kill_sessions(self.children)


def _role(pid: int) -> str:
    """The process's --name, or its dynabatch command (the scheduler has no name)."""
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    if "--name" in argv:
        return argv[argv.index("--name") + 1]
    return argv[argv.index("dynabatch.cli.main") + 1] if "dynabatch.cli.main" in argv else ""


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def _temporary_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".part"))]


def _interrupted_summary(run: Run, out: str, evaluated: int) -> None:
    """summary.json says interrupted, with the last evaluated model's figures and version, and so does stdout."""
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["interrupted"] and not summary["finished"]
    assert summary["final_eval_version"] >= evaluated and summary["model_version"] >= summary["final_eval_version"]
    assert summary["final_test_acc"] is not None
    line = re.search(r"^interrupted at model v(\d+) \(epoch [\d.]+\); last evaluation, of model v(\d+) at [\d.]+ s: "
                     r"test accuracy ([\d.]+)%", out, re.M)
    assert line, out
    assert int(line.group(2)) == summary["final_eval_version"]
    assert float(line.group(3)) == pytest.approx(100 * summary["final_test_acc"], abs=0.006)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_stops_the_run_in_order_and_reports_the_last_evaluated_model(run, sig):
    evaluated = run.trained_and_evaluated()
    run.proc.send_signal(sig)
    rc, out, err = run.end()
    assert rc == 128 + sig, err
    assert "Traceback" not in err, err
    assert "stopping (Ctrl-C again to force)..." in err
    assert not run.leftovers(0), "every child was stopped before the run exited"
    _interrupted_summary(run, out, evaluated)
    assert not _temporary_files(run.dir)


def test_a_second_ctrl_c_kills_every_child_and_still_reports(run):
    evaluated = run.trained_and_evaluated()
    run.proc.send_signal(signal.SIGINT)
    wait_for("the run to begin stopping", lambda: "stopping" in run.err_path.read_text(), 30)
    run.proc.send_signal(signal.SIGINT)
    rc, out, err = run.end()
    assert rc == 130, err
    assert "Traceback" not in err, err
    assert "forced: killing every process of the run" in err
    assert not run.leftovers(0), "every child was killed before the run exited"
    _interrupted_summary(run, out, evaluated)


def test_children_of_a_run_killed_outright_end_with_it(run):
    run.trained_and_evaluated()
    run.proc.kill()
    rc, _, _ = run.end()
    assert rc == -signal.SIGKILL
    # They get SIGTERM from the kernel and stop as on Ctrl-C: within the launcher's own stop bound.
    assert not run.leftovers(30), "the parent-death signal ends every child"
    assert not _temporary_files(run.dir)
