"""How long a test waits before it calls a wait a hang: the seconds it allows on a quiet machine, times the load
per core measured when the wait starts, and never past the running test's own limit.

A guard asserts nothing about speed (speed is measured in bench/); it only stops a test that would otherwise wait
for ever. Fixed guards of 60 to 120 s, and pytest's 300 s, each several times what the wait takes in a lone suite,
ran out beside a second suite on two cores (a load of 8 to 10) on waits that had nothing wrong with them
(bench/RESULTS.md 66.4 and 66.5). Scaled by the load they keep their margin on any machine, and a real hang still
fails, later by the same factor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

# When pytest-timeout stops the running test (time.monotonic(); conftest.py sets it as each test starts): a guard
# that would end later never fires, and a `dynabatch run` told to stop by then could not leave its logs behind.
_test_ends_at: float | None = None


def load_per_core() -> float:
    """This machine's one-minute load average over the cores this process may run on, at least 1 (quiet)."""
    return max(1.0, os.getloadavg()[0] / len(os.sched_getaffinity(0)))


def scaled_s(alone_s: float) -> float:
    """`alone_s`, what a wait is allowed on a quiet machine, times the load per core now."""
    return alone_s * load_per_core()


@contextmanager
def within_test_limit(limit_alone_s: float) -> Iterator[float]:
    """While the running test lasts: its own limit from now, `limit_alone_s` scaled (pytest-timeout's; conftest.py
    enters this as each test starts), which the guards set during it do not pass."""
    global _test_ends_at
    outer, limit = _test_ends_at, scaled_s(limit_alone_s)
    _test_ends_at = time.monotonic() + limit
    try:
        yield limit
    finally:
        _test_ends_at = outer


def hang_guard_s(alone_s: float) -> float:
    """`alone_s` scaled by the load the wait starts under, ending no later than the running test's limit."""
    guard = scaled_s(alone_s)
    if _test_ends_at is None:
        return guard
    return max(1.0, min(guard, _test_ends_at - time.monotonic()))
