"""`--cpu-durations N`: the N tests that cost the most CPU, what the suite's time is made of on two cores.

The suite is CPU-bound (bench/RESULTS.md 52): its wall time is its CPU over the cores, so a test's wall time says
little about what it costs the others, and `--durations` ranks by wall time. A test's CPU here is its test
process's own and that of every process it started: those it reaped (`RUSAGE_CHILDREN`), and those a process of
its reaped or still runs, read from /proc (a job's preloader reaps the shards and workers it forked, and a test
process's shared preloader lives on after the test). Module fixtures count where pytest runs them, as in
`--durations`: in the first test's setup and the last one's teardown. Linux only (/proc).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Generator
from pathlib import Path

import pluggy
import pytest

CPU_KEY = "cpu_s"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_started: dict[str, float] = {}  # by test: the CPU when its setup began (in the process that runs it)
_collected: dict[str, float] = {}  # by test: its CPU, where the reports meet


def process_cpu_s(stat: str) -> tuple[int, float]:
    """(parent pid, CPU seconds of the process and of the children it reaped) from a /proc/PID/stat line."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), sum(int(f) for f in fields[11:15]) * _TICK_S  # utime, stime, cutime, cstime


def descendants_cpu_s(root: int) -> dict[tuple[int, str], float]:
    """Each live descendant of `root`'s CPU (with what it reaped), keyed by (pid, start time): a pid reused by a
    later process is another key."""
    parents: dict[int, int] = {}
    cpu: dict[tuple[int, str], float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        pid = int(entry.name)
        parents[pid], seconds = process_cpu_s(stat)
        cpu[(pid, stat.rsplit(")", 1)[1].split()[19])] = seconds
    mine: dict[tuple[int, str], float] = {}
    for key, seconds in cpu.items():
        pid, hops = key[0], 0
        while pid in parents and pid != root and hops < 64:
            pid, hops = parents[pid], hops + 1
        if pid == root and key[0] != root:
            mine[key] = seconds
    return mine


def tree_cpu_s() -> float:
    """This process's CPU, its reaped children's, and every live descendant's (with what each reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(descendants_cpu_s(os.getpid()).values())
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + live


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("terminal reporting").addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that cost the most CPU, with the processes they started (0: all)",
    )


def _on(config: pytest.Config) -> bool:
    return config.getoption("cpu_durations") is not None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if _on(item.config):
        _started[item.nodeid] = tree_cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    if call.when == "teardown" and item.nodeid in _started:
        outcome.get_result().user_properties.append((CPU_KEY, tree_cpu_s() - _started.pop(item.nodeid)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Where the reports meet (the controller, under pytest-xdist), each test's teardown report carries its CPU."""
    for key, value in report.user_properties if report.when == "teardown" else ():
        if key == CPU_KEY and isinstance(value, float):
            _collected[report.nodeid] = value


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _on(config) or not _collected:
        return
    n = config.getoption("cpu_durations")
    ranked = sorted(_collected.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"most CPU, {len(ranked) if not n else min(n, len(ranked))} tests")
    for nodeid, seconds in ranked[: n or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")
    terminalreporter.write_line(f"{sum(_collected.values()):8.2f}s in all, {len(ranked)} tests")
