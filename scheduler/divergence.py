"""Divergence told from what workers and shards report, without sockets.

A model that blows up shows it in three ways, and the scheduler hears all of them:

- a shard's parameter guard finds its parameters non-finite or far above their
  running norm (ps/param_guard.py; `ShardHeartbeat.model_problem`);
- most workers' losses are not finite, so they skip their steps (`WorkerHeartbeat.skipped`
  counts them): `STRIKES` skipped in a row;
- most workers' losses are far above the job's running level: more than
  `LOSS_FACTOR` times it in `STRIKES` progress reports in a row. A worker's level
  is an exponential average of its healthy losses; the job's is taken as at least
  `FLOOR_FRACTION` of the first levels seen, so a model trained to a loss near zero
  is not called diverged for a batch at a few times that.

The watch only says why the job diverged (`cause`); the job (rollbacks.py) rolls
it back (every shard to its last good checkpoint, `lr_factor` halved) or gives
up after `--max-rollbacks`. Reports made before every shard applied the last
rollback describe the model that was thrown away: they are not held against
the job (`settled`), and every worker's count starts again from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dynabatch.common.wire.messages import ShardHeartbeat, WorkerHeartbeat

LOSS_FACTOR = 10.0  # a loss this many times the job's running level is a blow-up, not noise
FLOOR_FRACTION = 0.1  # the level is taken as at least this fraction of the first level seen
STRIKES = 3  # reports in a row (skipped steps, or losses far above the level) that make a divergence
LEVEL_WEIGHT = 0.1  # weight of one healthy report in the running level
LR_CUT = 0.5  # each rollback multiplies the job's step size by this


def lr_factor(rollbacks: int) -> float:
    """The job's step-size factor after `rollbacks` rollbacks."""
    return LR_CUT**rollbacks


@dataclass
class WorkerTrack:
    """One worker's record: its loss level, its skipped count at its last healthy report and at its latest,
    and what looks wrong with its latest reports (empty: nothing)."""

    skipped_at_healthy: int = 0
    skipped: int = 0
    strikes: int = 0  # progress reports in a row whose loss was far above the job's level
    level: float = math.nan  # the average of its healthy losses
    first_level: float = math.nan
    trouble: str = ""

    @property
    def uneasy(self) -> bool:
        """Some sign of divergence short of trouble: a step skipped, or a loss above the level, since its last
        healthy report."""
        return bool(self.trouble or self.strikes or self.skipped > self.skipped_at_healthy)

    def start_again(self) -> None:
        """Its earlier reports are of a model thrown away: count from here."""
        self.skipped_at_healthy, self.strikes, self.trouble = self.skipped, 0, ""


class DivergenceWatch:
    """Each worker's record, the job's loss level from them, and why the job diverged (empty: it has not).

    Workers' evidence counts only when most of the workers that train show it: a
    model that diverged fails every worker, while one worker that reports skipped
    steps or wild losses (a bad machine, or a lying peer) cannot roll the job back
    or hold its checkpoints alone. The job's level is the upper median of the
    workers' own levels, for the same reason. A shard's report of its own
    parameters counts alone: the shard holds the model.
    """

    def __init__(self) -> None:
        self.workers: dict[str, WorkerTrack] = {}
        self.cause = ""

    @property
    def level(self) -> float:
        """The job's loss level: the upper median of the workers' levels (NaN before any healthy loss)."""
        return _upper_median([t.level for t in self.workers.values()])

    @property
    def loss_limit(self) -> float:
        """The loss above which a report counts against the job (inf until a level is known)."""
        level = self.level
        if not level > 0:
            return math.inf
        return LOSS_FACTOR * max(level, FLOOR_FRACTION * _upper_median([t.first_level for t in self.workers.values()]))

    @property
    def suspect(self) -> bool:
        """Most workers' latest reports look diverged, short of a divergence: a shard should keep its last
        checkpoint rather than write this model."""
        return bool(self.cause) or self._most(lambda t: t.uneasy)

    def worker(self, wid: str, prev: WorkerHeartbeat, hb: WorkerHeartbeat, settled: bool) -> None:
        """Take worker `wid`'s heartbeat `hb` (its previous one was `prev`)."""
        if hb.steps == prev.steps and hb.skipped == prev.skipped:
            return  # a repeat (the pulse), or a report of nothing new
        track = self.workers.setdefault(wid, WorkerTrack(prev.skipped, prev.skipped))
        track.skipped = hb.skipped
        if not settled:
            track.start_again()
            return
        limit = self.loss_limit
        # A worker's first finite loss starts its own level: the job's may be another worker's, or a liar's.
        if hb.steps > prev.steps and math.isfinite(hb.loss) and (hb.loss <= limit or math.isnan(track.level)):
            track.start_again()
            if math.isnan(track.level):
                track.level = track.first_level = hb.loss
            else:
                track.level += LEVEL_WEIGHT * (hb.loss - track.level)
            return
        if hb.steps > prev.steps and math.isfinite(hb.loss):
            track.strikes += 1
        skipped = hb.skipped - track.skipped_at_healthy
        if skipped >= STRIKES:
            track.trouble = f"{wid} skipped {skipped} steps in a row: their loss was not finite"
        elif track.strikes >= STRIKES:
            track.trouble = (
                f"{wid}'s loss {hb.loss:.3g} was above {limit:.3g} ({LOSS_FACTOR:g}x the running "
                f"level) {track.strikes} times in a row"
            )
        troubled = [t.trouble for t in self.workers.values() if t.trouble]
        if self._most(lambda t: bool(t.trouble)):
            also = f"; {len(troubled)} of {len(self.workers)} workers alike" if len(self.workers) > 1 else ""
            self._trip(track.trouble + also if track.trouble else troubled[0] + also)

    def shard(self, index: int, hb: ShardHeartbeat, settled: bool) -> None:
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
            track.start_again()

    def _most(self, sign: Callable[[WorkerTrack], bool]) -> bool:
        """Whether more than half of the workers that train show `sign`."""
        return 2 * sum(1 for t in self.workers.values() if sign(t)) > len(self.workers)

    def _trip(self, cause: str) -> None:
        self.cause = self.cause or cause


def _upper_median(values: list[float]) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    return finite[len(finite) // 2] if finite else math.nan
