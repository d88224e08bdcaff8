"""Logging of refusals (messages, connections), rate-limited: a flood of bad input must not become a flood of lines.

The first few refusals in each interval are logged as they come; the rest are
counted and summarised in one line when the interval ends (or with the next
refusal after it). Every refusal is still counted in Prometheus by its code.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

LINES_PER_INTERVAL = 10
INTERVAL_S = 10.0


class RateLimitedLog:
    """At most LINES_PER_INTERVAL lines per INTERVAL_S, then a summary of what was left out, by code."""

    def __init__(
        self,
        log: logging.Logger,
        lines: int = LINES_PER_INTERVAL,
        interval_s: float = INTERVAL_S,
        what: str = "message",
    ) -> None:
        self.log, self.lines, self.interval_s, self.what = log, lines, interval_s, what
        self._start: float | None = None  # the interval starts with its first refusal
        self._logged = 0
        self._suppressed: Counter[str] = Counter()

    def refused(self, code: str, text: str, now: float | None = None) -> None:
        """Log one refusal (code, what was wrong) unless this interval's lines are spent."""
        now = time.monotonic() if now is None else now
        if self._start is None:
            self._start = now
        elif now - self._start >= self.interval_s:
            self.flush(now)
        if self._logged < self.lines:
            self._logged += 1
            self.log.warning("rejected a %s: %s", self.what, text)
        else:
            self._suppressed[code] += 1

    def flush(self, now: float | None = None) -> None:
        """Summarise what the interval left out, and start a new interval."""
        if self._suppressed:
            summary = ", ".join(f"{code} x{n}" for code, n in self._suppressed.most_common())
            self.log.warning(
                "rejected %d more %ss in the last %.0fs (not logged one by one): %s",
                sum(self._suppressed.values()),
                self.what,
                self.interval_s,
                summary,
            )
        self._start = time.monotonic() if now is None else now
        self._logged = 0
        self._suppressed.clear()
