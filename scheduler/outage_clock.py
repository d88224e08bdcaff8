"""How long the scheduler was down, from what it saved, without believing a clock that jumped.

The job's clock runs through a scheduler's outage (time to accuracy and the time
budget are wall time as the user saw it), so a restarted scheduler adds the time
since its last save. The wall clock may jump (NTP, a VM resumed, an operator's
mistake): a jump of 1e6 s would spend any --time-budget-s at once. On the same
machine since the same boot (Linux's boot_id), CLOCK_BOOTTIME measures the
outage instead: it never jumps and counts suspended time. A scheduler restarted
elsewhere (a pod moved to another node) has only the wall clock, and believes
at most `MAX_UNTIMED_OUTAGE_S` of it, a bound well above a restart's usual minutes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

MAX_UNTIMED_OUTAGE_S = 600.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ClockReading:
    """The time now by the wall clock and, where the machine tells it, since its boot."""

    wall: float
    boot_id: str = ""
    boot_s: float | None = None


def read_clock() -> ClockReading:
    try:
        boot_id = BOOT_ID.read_text().strip()
        boot_s = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, AttributeError):
        return ClockReading(time.time())
    return ClockReading(time.time(), boot_id, boot_s)


def outage_s(saved: ClockReading, now: ClockReading) -> float:
    """Seconds from `saved` to `now`: by the boot clock on the same boot, else by the wall clock, bounded."""
    if saved.boot_id and saved.boot_id == now.boot_id and saved.boot_s is not None and now.boot_s is not None:
        return max(0.0, now.boot_s - saved.boot_s)
    return min(MAX_UNTIMED_OUTAGE_S, max(0.0, now.wall - saved.wall))
