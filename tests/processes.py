"""Which processes a `dynabatch run` started, found in /proc, and whether any outlived it.

The run's children sit in sessions of their own, so neither a terminal's Ctrl-C nor a
process-group kill of the run reaches them: they are found by parent id while the run
lives, and checked by id afterwards (a zombie counts as gone: it runs nothing). The
same reading of /proc gives a test's CPU with its processes' (tests/cpu_durations.py).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """What /proc/PID/stat says of a process that the tests read: its state, its parent, and its CPU."""

    state: str  # "Z": a zombie, which runs nothing
    ppid: int
    cpu_s: float  # user and system time, its own and that of the children it reaped


def parse_stat(line: str) -> ProcStat:
    """A /proc/PID/stat line read; the name, in parentheses, may hold spaces and ')'."""
    fields = line.rsplit(")", 1)[1].split()
    return ProcStat(fields[0], int(fields[1]), sum(int(f) for f in fields[11:15]) * _TICK_S)  # utime .. cstime


def _stat(pid: int) -> ProcStat | None:
    """`pid`'s stat, or None if there is no such process."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        return None


def table() -> dict[int, ProcStat]:
    """Every process's stat, read from /proc in one pass (those gone since the listing left out)."""
    return {int(e.name): st for e in Path("/proc").iterdir() if e.name.isdigit() and (st := _stat(int(e.name)))}


def below(pid: int, parents: dict[int, int]) -> set[int]:
    """Every process under `pid` in `parents` (process: its parent), children of children included."""
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, children of children included."""
    return below(pid, {p: st.ppid for p, st in table().items() if st.state != "Z"})


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (not gone, not zombies)."""
    return {p for p in pids if (st := _stat(p)) is not None and st.state != "Z"}


def kill_sessions(pids: set[int]) -> None:
    """SIGKILL each session that one of `pids` leads (the run's children do): the clean-up of a test that
    failed with processes left over. A process that leads none is killed alone."""
    for pid in alive(pids):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def mentioning(text: str) -> set[int]:
    """Live processes whose command line holds `text` (a test's own folder): what a finished run left running."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in argv and alive({int(entry.name)}):
            found.add(int(entry.name))
    return found


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
