"""When each model version existed: the job's time at which the shards first reported it.

An evaluation names the version it evaluated and arrives one evaluation later
(seconds on a slow evaluator); a time to target is the time that model existed,
so the scheduler keeps, for the versions the shards reported, when it learned of
each (a shard heartbeats every --heartbeat-s, so this is at most one heartbeat
late). The model's version is its least advanced shard's, as a pull sees it.
The record is bounded: it keeps the newest MAX_KEPT advances, enough for any
evaluation still on its way; an older version is placed no later than the
oldest time kept, which it existed before.
"""

from __future__ import annotations

import bisect
from collections import deque

MAX_KEPT = 4096


class VersionTimes:
    """(version, job time) at each advance of the model's version, in order, the newest MAX_KEPT of them."""

    def __init__(self) -> None:
        self.versions: deque[int] = deque(maxlen=MAX_KEPT)
        self.times: deque[float] = deque(maxlen=MAX_KEPT)

    def observe(self, version: int, t: float) -> None:
        """The model is at `version` at job time `t`. A lower version is a rollback: the versions above it were
        of the abandoned model, and are forgotten."""
        while self.versions and self.versions[-1] > version:
            self.versions.pop()
            self.times.pop()
        if not self.versions or version > self.versions[-1]:
            self.versions.append(version)
            self.times.append(t)

    def time_of(self, version: int, reported_t: float) -> float:
        """The job time at which `version` existed: the first time the shards were at it or past it, and never
        later than `reported_t` (an evaluation of it arrived then: the shards' heartbeat may not have yet)."""
        i = bisect.bisect_left(self.versions, version)
        return min(reported_t, self.times[i]) if i < len(self.times) else reported_t
