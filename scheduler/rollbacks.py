"""A diverged job goes back to its shards' last good checkpoints with a smaller step size.

divergence.py says why the job diverged; this class orders the rollback (every
shard to its last good version, the step size halved), follows the shards as
they apply it, and says when the model is in doubt: between a divergence and the
moment every shard has restored its checkpoint, reports describe a model that is
thrown away.
"""

from __future__ import annotations

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import Rollback, ShardHeartbeat, WorkerHeartbeat
from dynabatch.scheduler.divergence import DivergenceWatch, lr_factor
from dynabatch.scheduler.roster import Roster
from dynabatch.scheduler.saved_progress import SavedProgress


class Rollbacks:
    """Divergence and rollbacks: the watch, the rollbacks ordered, and the last one every shard has applied."""

    def __init__(self, job: JobConfig, roster: Roster) -> None:
        self.job = job
        self.roster = roster
        self.divergence = DivergenceWatch()
        self.rollbacks: list[Rollback] = []
        self.rollback_number = 0  # the last rollback ordered (a shard may know of a later one than a fresh scheduler)
        self.rollback_done = 0  # the last rollback every shard has applied: what workers are told to act on

    @property
    def lr_factor(self) -> float:
        """The job's step-size factor after its rollbacks."""
        return lr_factor(self.rollback_number)

    @property
    def settled(self) -> bool:
        """Has every shard applied the last rollback? Until then reports describe the model thrown away."""
        return len(self.roster.shards) == self.roster.num_shards and all(
            shard.shard_last.rollbacks >= self.rollback_number for shard in self.roster.shards.values()
        )

    def settle(self) -> None:
        """Once every shard has applied the last rollback, workers are told to act on it (`rollback_done`).

        Only a shard's heartbeat can settle a rollback (a new shard, a drop or a new rollback cannot), so the
        heartbeat path calls this after each shard's report."""
        if self.settled:
            self.rollback_done = self.rollback_number

    @property
    def in_doubt(self) -> bool:
        """The job diverged and is not yet rolled back: a cause is known, a rollback is ordered that not every
        shard has applied, or a shard reports its parameters sick."""
        pending = self.rollback_number > self.rollback_done and not self.settled
        return (
            bool(self.divergence.cause)
            or pending
            or any(s.shard_last.model_problem for s in self.roster.shards.values())
        )

    def worker_report(self, worker: str, prev: WorkerHeartbeat, hb: WorkerHeartbeat) -> None:
        """A worker's report counts once it has dropped the model of before the last rollback, which it is told
        to do only once every shard has restored its checkpoint (`rollback_done`)."""
        self.divergence.worker(worker, prev, hb, hb.rollbacks >= self.rollback_number and self.settled)

    def shard_report(self, index: int, prev: ShardHeartbeat, hb: ShardHeartbeat) -> None:
        """A shard's heartbeat (`prev` its previous one): the rollbacks it knows of, the version it restored, and
        whether its parameters are sick."""
        self.rollback_number = max(self.rollback_number, hb.rollbacks)
        self.settle()
        self._shard_rolled_back(index, prev, hb)
        self.divergence.shard(index, hb, self.settled)

    def _shard_rolled_back(self, index: int, prev: ShardHeartbeat, hb: ShardHeartbeat) -> None:
        """Record the version a shard restored: its first report after the rollback, sent before it took a push."""
        last = self.rollbacks[-1] if self.rollbacks else None
        if last is None or last.done or not prev.rollbacks < last.number <= hb.rollbacks:
            return
        last.versions[str(index)] = hb.version
        last.done = self.settled

    def react(self, t: float, epoch: float) -> str:
        """Roll the job back if it diverged (every shard to its last good checkpoint, half the step size); once it
        has rolled back --max-rollbacks times, returns why the job gives up instead."""
        cause = self.divergence.cause
        if not cause:
            return ""
        if self.rollback_number >= self.job.max_rollbacks:
            return (
                f"diverged at epoch {epoch:.2f} ({cause}) after {self.rollback_number} rollback(s) "
                f"(--max-rollbacks {self.job.max_rollbacks}); lower --lr or check the task"
            )
        self.rollback_number += 1
        self.rollbacks.append(
            Rollback(
                self.rollback_number,
                t,
                epoch,
                cause,
                {str(i): m.shard_last.good_version for i, m in sorted(self.roster.shards.items())},
                lr_factor(self.rollback_number),
            )
        )
        self.divergence.rolled_back()
        return ""

    def forget(self, worker: str) -> None:
        """A worker left: its reports no longer count."""
        self.divergence.forget(worker)

    def restore(self, saved: SavedProgress) -> None:
        """A saved job's rollbacks: all of them applied (its shards restored them before it was saved)."""
        self.rollbacks = list(saved.rollbacks)
        self.rollback_number = self.rollback_done = len(self.rollbacks)
