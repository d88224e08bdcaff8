"""How far the job is: samples trained, epochs, work shards lost, the training loss, and the job's clock.

Workers report the samples they trained since they registered; those of workers
that left are kept here, so the job's count survives departures and (through the
saved progress) a restart of the scheduler. A shard that comes back from an older
checkpoint lost the samples after it (lost_work.py): they are counted back, so the
job still trains as long as it was asked.
"""

from __future__ import annotations

import logging
import math

from dynabatch.common import staleness
from dynabatch.common.config import JobConfig
from dynabatch.common.wire.messages import ShardHeartbeat
from dynabatch.scheduler.lost_work import LostWork, ShardMark, lost_work
from dynabatch.scheduler.roster import Member, Roster
from dynabatch.scheduler.saved_progress import SavedProgress

log = logging.getLogger("dynabatch.scheduler")
LOSSES_KEPT = 100  # shard restarts not yet logged by the server
MAX_TRAIN_SIZE = 1 << 40
LOSS_SMOOTHING = 0.9


class Progress:
    """Progress: the job's sample count and epochs, lost work, the smoothed loss, and when the job started.

    It reads the live workers' counters from the roster and keeps what no live member reports any more.
    """

    def __init__(self, job: JobConfig, roster: Roster, train_size: int, started: float) -> None:
        self.job = job
        self.roster = roster
        self.started = started  # the job's time zero on this process's monotonic clock
        self.train_size = train_size
        self.departed_samples = 0
        self.departed_bytes = 0
        self.departed_staleness: list[int] = []
        self.loss = math.nan
        self.lost_samples = 0  # samples shards lost in restarts, counted back into the job
        self.lost_versions = 0
        self.shard_marks: dict[int, ShardMark] = {}  # each slot's newest reported version and samples
        self.losses: list[LostWork] = []  # restarts the server has yet to log
        self.unchecked_shards: set[int] = set()  # after a resume: shard slots yet to report their samples
        self.most_shard_samples = 0

    def t(self, now: float) -> float:
        """The job's time at `now`."""
        return now - self.started

    @property
    def samples(self) -> int:
        return self.departed_samples + sum(m.samples for m in self.roster.workers())

    @property
    def kept_samples(self) -> int:
        """The samples whose updates the model still holds: those trained, less those shards lost."""
        return max(0, self.samples - self.lost_samples)

    @property
    def epoch(self) -> float:
        """The job's progress in passes over the training set, counted from the samples the model holds."""
        return self.kept_samples / self.train_size if self.train_size else 0.0

    @property
    def budget(self) -> int | None:
        """The samples the job is to train: its epochs of the training set, and the work shards lost counted back
        (None until a shard has reported the training set's size)."""
        if not self.train_size:
            return None
        return math.ceil(self.job.epochs * self.train_size) + self.lost_samples

    @property
    def bytes(self) -> int:
        """Tensor bytes moved between workers and shards (both directions), from workers' counters."""
        return self.departed_bytes + sum(m.last.bytes for m in self.roster.workers())

    @property
    def staleness_counts(self) -> list[int]:
        """Updates by staleness over the whole job, departed workers included."""
        total = self.departed_staleness
        for m in self.roster.workers():
            total = staleness.add(total, m.last.staleness)
        return total

    @property
    def newest_possible_version(self) -> int:
        """No shard can be past this version: every update takes a push of at least --min-batch samples but a
        worker's last one, sized to what its allotment left, and every worker may have one push on its way that
        its heartbeat has not counted yet."""
        pushes = math.ceil(self.samples / self.job.min_batch) + 2 * len(self.roster.live_workers) + 1
        return max(self.roster.newest_shard_version(), pushes)

    def worker_left(self, member: Member) -> None:
        """Keep what a live worker that left had counted."""
        self.departed_samples += member.samples
        self.departed_bytes += member.last.bytes
        self.departed_staleness = staleness.add(self.departed_staleness, member.last.staleness)

    def observe_loss(self, loss: float) -> None:
        """Smooth a worker's finite training loss into the job's."""
        if math.isfinite(loss):
            self.loss = loss if math.isnan(self.loss) else LOSS_SMOOTHING * self.loss + (1 - LOSS_SMOOTHING) * loss

    def shard_report(self, index: int, hb: ShardHeartbeat) -> None:
        """What a shard's heartbeat says about progress: the training set's size, its version and samples."""
        if 0 < hb.train_size <= MAX_TRAIN_SIZE:
            self.train_size = hb.train_size
        self._shard_progress(index, hb)
        self._check_resumed(index, hb.samples)

    def _shard_progress(self, index: int, hb: ShardHeartbeat) -> None:
        """Follow a shard slot's version; a drop is a restart that lost work, counted back into the job."""
        mark = self.shard_marks.get(index, ShardMark())
        lost = lost_work(index, mark, hb.version, hb.samples, self.kept_samples)
        if lost is not None:
            self.lost_versions += lost.versions
            self.lost_samples += lost.samples
            self.losses.append(lost)
            del self.losses[:-LOSSES_KEPT]
        self.shard_marks[index] = ShardMark(hb.version, hb.samples)

    def _check_resumed(self, index: int, shard_samples: int) -> None:
        """After a resume, once every shard slot has reported: the samples the job counts cannot exceed what the
        shards say they were pushed (the most of any shard, plus what shards lost, plus a global batch in flight);
        a saved figure beyond that (an edited or foreign file) is cut back, with a warning."""
        if not self.unchecked_shards:
            return
        self.most_shard_samples = max(self.most_shard_samples, shard_samples)
        self.unchecked_shards.discard(index)
        if self.unchecked_shards:
            return
        allowed = self.most_shard_samples + self.lost_samples + self.job.global_batch
        excess = min(self.samples - allowed, self.departed_samples)
        if excess > 0:
            log.warning(
                "the saved progress counts %d samples but the shards hold at most %d: counting %d fewer",
                self.samples,
                allowed,
                excess,
            )
            self.departed_samples -= excess

    def restore(self, saved: SavedProgress, now: float) -> None:
        """Go on from `saved` at `now` (the outage already taken off): its samples count as trained by workers that
        left, checked against the shards' own counts once every shard slot has reported."""
        self.unchecked_shards = set(range(self.roster.num_shards))
        self.started = now - saved.t
        self.departed_samples = saved.samples
        self.lost_samples, self.lost_versions = saved.lost_samples, saved.lost_versions
        self.train_size = saved.train_size
        self.loss = math.nan if saved.loss is None else saved.loss
        self.shard_marks = dict(saved.shard_marks)
