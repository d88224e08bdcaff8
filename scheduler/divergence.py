"""Divergence told from what workers and shards report, without sockets.

A model that blows up shows it in three ways, and the scheduler hears all of them:

- a shard's parameter guard finds its parameters non-finite or far above their
  running norm (ps/param_guard.py; `Heartbeat.model_problem`);
- a worker's loss is not finite, so it skips its steps (`Heartbeat.skipped` counts
  them): `STRIKES` skipped in a row;
- a worker's loss is far above the job's running level: more than `LOSS_FACTOR`
  times it in `STRIKES` progress reports in a row. The level is an exponential
  average of healthy losses, taken as at least `FLOOR_FRACTION` of the first level
  seen, so a model trained to a loss near zero is not called diverged for a
  batch at a few times that.

The watch only says why the job diverged (`cause`); the job (job_state.py) rolls
it back (every shard to its last good checkpoint, `lr_factor` halved) or gives
up after `--max-rollbacks`. Reports made before every shard applied the last
rollback describe the model that was thrown away: they are not held against
the job (`settled`), and every worker's count starts again from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynabatch.common.messages import Heartbeat

LOSS_FACTOR = 10.0  # a loss this many times the job's running level is a blow-up, not noise
FLOOR_FRACTION = 0.1  # the level is taken as at least this fraction of the first level seen
STRIKES = 3  # reports in a row (skipped steps, or losses far above the level) that make a divergence
LEVEL_WEIGHT = 0.1  # weight of one healthy report in the running level
LR_CUT = 0.5  # each rollback multiplies the job's step size by this


def lr_factor(rollbacks: int) -> float:
    """The job's step-size factor after `rollbacks` rollbacks."""
    return LR_CUT ** rollbacks


@dataclass
class WorkerTrack:
    """One worker's record: its skipped count at its last healthy report, and at its latest."""

    skipped_at_healthy: int = 0
    skipped: int = 0
    strikes: int = 0  # progress reports in a row whose loss was far above the level


class DivergenceWatch:
    """The job's loss level, each worker's record, and why the job diverged (empty: it has not)."""

    def __init__(self) -> None:
        self.level = math.nan
        self.first_level = math.nan
        self.workers: dict[str, WorkerTrack] = {}
        self.cause = ""

    @property
    def loss_limit(self) -> float:
        """The loss above which a report counts against the job (inf until a level is known)."""
        if not self.level > 0:
            return math.inf
        return LOSS_FACTOR * max(self.level, FLOOR_FRACTION * self.first_level)

    @property
    def suspect(self) -> bool:
        """Some worker's latest reports look diverged, short of a divergence: a shard should keep its last
        checkpoint rather than write this model."""
        return bool(self.cause) or any(t.strikes or t.skipped > t.skipped_at_healthy for t in self.workers.values())

    def worker(self, wid: str, prev: Heartbeat, hb: Heartbeat, settled: bool) -> None:
        """Take worker `wid`'s heartbeat `hb` (its previous one was `prev`)."""
        track = self.workers.setdefault(wid, WorkerTrack(prev.skipped, prev.skipped))
        if hb.steps == prev.steps and hb.skipped == prev.skipped:
            return  # a repeat (the pulse), or a report of nothing new
        track.skipped = hb.skipped
        if not settled:
            track.skipped_at_healthy, track.strikes = hb.skipped, 0
            return
        if hb.steps > prev.steps and math.isfinite(hb.loss) and hb.loss <= self.loss_limit:
            track.skipped_at_healthy, track.strikes = hb.skipped, 0
            self._follow(hb.loss)
            return
        if hb.steps > prev.steps and math.isfinite(hb.loss):
            track.strikes += 1
        skipped = hb.skipped - track.skipped_at_healthy
        if skipped >= STRIKES:
            self._trip(f"{wid} skipped {skipped} steps in a row: their loss was not finite")
        elif track.strikes >= STRIKES:
            self._trip(f"{wid}'s loss {hb.loss:.3g} was above {self.loss_limit:.3g} ({LOSS_FACTOR:g}x the running "
                       f"level) {track.strikes} times in a row")

    def shard(self, index: int, hb: Heartbeat, settled: bool) -> None:
        """Take shard `index`'s heartbeat: a problem with its parameters is a divergence."""
        if settled and hb.model_problem:
            self._trip(f"ps{index}: {hb.model_problem}")

    def forget(self, wid: str) -> None:
        """Worker `wid` left the job."""
        self.workers.pop(wid, None)

    def rolled_back(self) -> None:
        """A rollback was ordered: the cause is dealt with, and every worker's count starts again."""
        self.cause = ""
        for track in self.workers.values():
            track.skipped_at_healthy, track.strikes = track.skipped, 0

    def _follow(self, loss: float) -> None:
        if math.isnan(self.level):
            self.level = self.first_level = loss
        else:
            self.level += LEVEL_WEIGHT * (loss - self.level)

    def _trip(self, cause: str) -> None:
        self.cause = self.cause or cause
