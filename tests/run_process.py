"""A `dynabatch run` started as a user starts it, followed from outside: its scheduler's STATUS, its processes,
how it ended and what it left behind."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import zmq

from hang_guard import hang_guard_s
from harness import alone_env, command_line, status_at, wait_for
from processes import alive, descendants, kill_sessions

ROLES = {"scheduler", "ps0", "worker0", "evaluator"}
# Trains for ever (synthetic data, a small MLP, a worker and the evaluator: a process of every role the run starts,
# each of which costs 2 s of CPU to start), sampled and evaluated often.
FOREVER = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--epochs",
    "1000",
    "--workers",
    "1",
    "--slowdowns",
    "1",
    "--eval-interval-s",
    "0.5",
    "--status-s",
    "0.2",
    "--timeout-s",
    "250",
]


def _role(pid: int) -> str:
    """The process's --name, or its dynabatch command (the scheduler has no name)."""
    argv = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").split()  # a forked role's is one string
    if "--name" in argv:
        return argv[argv.index("--name") + 1]
    return argv[argv.index("dynabatch.cli.main") + 1] if "dynabatch.cli.main" in argv else ""


class RunProcess:
    """`dynabatch run --out OUT --name r FLAGS`, its stdout and its stderr each in a file (readable as it runs)."""

    def __init__(self, out: Path, err_path: Path, flags: list[str], cwd: Path | None = None) -> None:
        self.dir, self.err_path = out / "r", err_path
        self.out_path = err_path.with_suffix(".out")
        with open(self.err_path, "wb") as err, open(self.out_path, "wb") as printed:
            self.proc = subprocess.Popen(
                command_line("run", ["--out", str(out), "--name", "r", *flags]),
                stdout=printed,
                stderr=err,
                env=alone_env(),  # its processes below it, where `trained_and_evaluated` finds them
                cwd=cwd,
            )
        self.children: set[int] = set()

    def printed(self) -> str:
        """What the run has printed so far (its progress lines, then its summary)."""
        return self.out_path.read_text()

    def trained_and_evaluated(self) -> int:
        """Wait until the evaluator has reported on a model past v0 and every role runs; that model's version."""
        log = self.dir / "logs" / "scheduler.log"
        found = wait_for(
            "the scheduler's endpoint",
            lambda: log.exists() and re.search(r"at (tcp://[0-9.]+:\d+)", log.read_text()),
            60,
        )
        ctx = zmq.Context()
        try:
            st = wait_for(
                "an evaluation of a trained model",
                lambda: (s := status_at(ctx, found.group(1))) and (s.eval_version or 0) > 0 and s,
                120,
            )
        finally:
            ctx.destroy(linger=0)
        self.children = descendants(self.proc.pid)
        assert {_role(pid) for pid in self.children} >= ROLES, self.children
        assert st.eval_version is not None
        return st.eval_version

    def end(self, timeout_s: float = 120) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once the run has exited (within `timeout_s`, a hang guard scaled by the
        load: `hang_guard`)."""
        self.proc.wait(timeout=hang_guard_s(timeout_s))
        return self.proc.returncode, self.printed(), self.err_path.read_text()

    def leftovers(self, timeout_s: float = 60) -> set[int]:
        """The run's processes still alive `timeout_s` (scaled by the load, `hang_guard`) after it ended
        (waiting for them to go)."""
        deadline = time.monotonic() + hang_guard_s(timeout_s)
        while alive(self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive(self.children)

    def temporary_files(self) -> list[Path]:
        return [p for p in self.dir.rglob("*") if p.name.endswith((".tmp", ".part"))]

    def close(self) -> None:
        """Whatever the test's outcome: the run and every process it started are gone."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_sessions(self.children)
