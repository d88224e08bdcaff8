"""Which processes a `dynabatch run` started, found in /proc, and whether any outlived it.

The run's children sit in sessions of their own, so neither a terminal's Ctrl-C nor a
process-group kill of the run reaches them: they are found by parent id while the run
lives, and checked by id afterwards (a zombie counts as gone: it runs nothing).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent id) of `pid`, or None if there is no such process."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, IndexError, ValueError):
        return None
    return state, int(ppid)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, children of children included."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and st[0] != "Z":
            parents[int(entry.name)] = st[1]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (not gone, not zombies)."""
    return {p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"}


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
