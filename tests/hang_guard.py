"""How long a test waits before it calls a wait a hang: the seconds it allows on a quiet machine, times the load
per core measured when the wait starts.

A guard asserts nothing about speed (speed is measured in bench/); it only stops a test that would otherwise wait
for ever. Fixed guards of 60 to 120 s, and pytest's 300 s, each several times what the wait takes in a lone suite,
ran out beside a second suite on two cores (a load of 8 to 10) on waits that had nothing wrong with them
(bench/RESULTS.md 66.4 and 66.5). Scaled by the load they keep their margin on any machine, and a real hang still
fails, later by the same factor.
"""

from __future__ import annotations

import os


def load_per_core() -> float:
    """This machine's one-minute load average over its cores, at least 1 (a quiet machine)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def hang_guard_s(alone_s: float) -> float:
    """`alone_s`, what a wait is allowed on a quiet machine, scaled by the load it starts under."""
    return alone_s * load_per_core()
