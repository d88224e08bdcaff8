"""The harness cleans up after a test: a run that ignores Ctrl-C is killed with every process it started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import interrupt, wait_for

# A parent that ignores SIGINT and starts a child in a session (so a process group) of its own, as
# `dynabatch run` starts its roles; the child ignores SIGINT too and prints its pid once it has set that up.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(600)"],
                         start_new_session=True, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_interrupt_kills_the_process_groups_of_a_run_that_outlasts_it() -> None:
    run = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert run.stdout is not None
    child = int(run.stdout.readline())
    assert _running(child)
    interrupt(run, timeout_s=1.0)  # both ignore Ctrl-C, so the second's deadline passes
    assert run.returncode == -9
    wait_for("the grandchild in its own process group to die", lambda: not _running(child), timeout_s=10)
