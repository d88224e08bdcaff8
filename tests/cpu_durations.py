"""`--cpu-durations N`: the N tests that cost the most CPU, what the suite's time is made of on two cores.

The suite is CPU-bound (bench/RESULTS.md 52): its wall time is its CPU over the cores, so a test's wall time says
little about what it costs the others, and `--durations` ranks by wall time. A test's CPU here is its test
process's own, that of the processes it reaped (`RUSAGE_CHILDREN`), and that of every live descendant with what
that descendant reaped, read from /proc: a job's preloader reaps the shards and workers it forked, and a test
process's shared preloader lives on after the test. Module fixtures count where pytest runs them, as in
`--durations`: in the first test's setup and the last one's teardown. Linux only (/proc).

Its limits: a process reparented out of the tree (a daemon that detaches, a child whose parent exited first) is
counted only up to the last reading that found it in the tree; a long-lived descendant is charged to whichever test
runs while it uses CPU; and /proc is not read atomically, so a child reaped between the reading of its parent and of
itself is missed (milliseconds, rarely). With `--junitxml`, each test case gains a `cpu_s` property.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Generator

import pytest

from processes import below, table

CPU_KEY = "cpu_s"
_started: dict[str, float] = {}  # by test: the CPU when its setup began (in the process that runs it)
_collected: dict[str, float] = {}  # by test: its CPU, where the reports meet


def live_descendants_cpu_s(root: int) -> float:
    """The CPU of `root`'s descendants still in /proc, each with what it reaped: a zombie's is not yet its
    parent's."""
    procs = table()
    return sum(procs[p].cpu_s for p in below(root, {p: st.ppid for p, st in procs.items()}))


def tree_cpu_s() -> float:
    """This process's CPU, its reaped children's, and every live descendant's (with what each reaped)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = live_descendants_cpu_s(os.getpid())
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + live


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("terminal reporting").addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that cost the most CPU, each counting every process it started (0: all)",
    )


def _on(config: pytest.Config) -> bool:
    return config.getoption("cpu_durations") is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if _on(item.config):
        _started[item.nodeid] = tree_cpu_s()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "teardown" and item.nodeid in _started:
        report.user_properties.append((CPU_KEY, tree_cpu_s() - _started.pop(item.nodeid)))
    return report


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
