"""`--cpu-durations` (tests/cpu_durations.py) counts the CPU of every process a test started, once: a grandchild reaped
by a child that still runs (a job's preloader reaping its workers), then that child reaped by the test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cpu_durations import tree_cpu_s
from hang_guard import hang_guard_s
from processes import parse_stat

BURN_S = 0.3
# The child forks a grandchild that burns BURN_S of CPU, reaps it, says so, and waits for its stdin to close.
CHILD = f"""
import os, sys, time
pid = os.fork()
if pid == 0:
    while time.process_time() < {BURN_S}:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("reaped", flush=True)
sys.stdin.read()
"""


def test_a_stat_line_gives_the_parent_and_the_cpu_with_what_was_reaped() -> None:
    line = "42 (my (odd) name) S 7 " + "0 " * 9 + "100 50 20 30 " + "0 " * 30  # after ppid, 9 fields to utime
    st = parse_stat(line)
    assert (st.state, st.ppid) == ("S", 7), "a name may hold ')' and spaces"
    assert st.cpu_s == pytest.approx(200 / os.sysconf("SC_CLK_TCK")), "utime, stime, cutime and cstime"


def test_a_grandchild_reaped_by_a_live_child_counts_once_before_and_after_the_child_is_reaped() -> None:
    before = tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "reaped"
    live = tree_cpu_s()  # the grandchild's CPU is in the child's reaped children, read from /proc
    child.stdin.close()
    assert child.wait(timeout=hang_guard_s(60)) == 0
    reaped = tree_cpu_s()  # now in this process's reaped children, and the child is no longer live
    # /proc counts whole ticks, rounded down: the grandchild may show a tick short
    assert live - before >= 0.9 * BURN_S, f"the grandchild's {BURN_S} s: {live - before:.3f} s counted"
    # The child's own start and exit after `live` was read cost it milliseconds; counted twice, the grandchild's
    # BURN_S would show here.
    assert reaped - live < BURN_S / 2, f"counted again once the child was reaped: {reaped - live:.3f} s"
