"""The last good model on disk: when a shard checkpoints, what it resumes, and the rollbacks to it.

A shard checkpoints right after its model is set (a shard killed before its
first interval resumes that model, not nothing), every --checkpoint-interval-s,
and as it stops; but only a healthy model (model_health.py), and not while the
scheduler sees workers' losses diverging (`hold`, ASSIGNMENT.hold_checkpoints):
the last good checkpoint must stay the one to go back to. When the scheduler
orders a rollback (ASSIGNMENT.rollbacks, numbered) the shard restores that
checkpoint, once per number. Either way its version drops, and the scheduler
counts the updates after the checkpoint back into the job (scheduler/lost_work.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from dynabatch.common.atomic_file import out_of_descriptors
from dynabatch.common.wire.messages import ShardAssignment
from dynabatch.ps.held_model import HeldModel
from dynabatch.ps.model_health import ModelHealth
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ShardState

log = logging.getLogger("dynabatch.ps")


class GoodCheckpoint:
    """The version of the last checkpoint written (`good_version`, -1: none), the number of the last rollback
    applied (the scheduler's count), whether checkpoints are held, and the model's health they depend on."""

    def __init__(self, served: ServedJob, interval_s: float, replays: ReplayGuard) -> None:
        self.served = served
        self.interval_s = interval_s
        self.replays = replays  # the PUSH seqs taken are kept with the model they went into
        self.health = ModelHealth(served.metrics)
        self.good_version = -1
        self.rollbacks = 0
        self.hold = False  # the scheduler sees workers' losses diverging: keep the last checkpoint
        self.next_at = time.monotonic() + interval_s

    def rollback_due(self, assignment: ShardAssignment, holds_model: bool) -> bool:
        """Take the scheduler's word on checkpoints (hold them while workers' losses look diverged); True if it
        orders a rollback this shard has not applied yet. Without a model (`holds_model` False) there is nothing
        to go back from: the number counts as applied."""
        self.hold = assignment.hold_checkpoints
        if not holds_model:
            self.rollbacks = max(self.rollbacks, assignment.rollbacks)
            return False
        return assignment.rollbacks > self.rollbacks

    def resume(self, held: HeldModel, saved: dict[str, Any]) -> None:
        """Go on from this shard's checkpoint `saved`, already loaded into `held`."""
        self.replays.restore(saved.get("replay_marks", {}))
        self.rollbacks = int(saved.get("rollbacks", 0))
        self.judge_restored(held.state)

    def judge_restored(self, model: ShardState) -> None:
        """Judge a model just restored from its checkpoint, which becomes the last good one if it is healthy."""
        if self.health.judge_afresh(model, self.good_version):
            self.good_version = model.version

    def updated(self, cids: Iterable[int], model: ShardState) -> None:
        """Chunks `cids` (at least one) of `model` were just updated: judge the model again."""
        self.health.updated(cids, model, self.good_version)

    def tick(self, now: float, held: HeldModel | None) -> None:
        """Checkpoint `held` if the interval has passed."""
        if self.served.checkpoint_path is not None and now >= self.next_at:
            self.write(held)
            self.next_at = now + self.interval_s

    def write(self, held: HeldModel | None) -> None:
        """Checkpoint `held` (None: no model yet), if this shard keeps checkpoints and the model may be one."""
        served = self.served
        if served.checkpoint_path is None or held is None:
            return
        version = held.state.version
        if self.health.problem or self.hold:
            served.metrics.checkpoints_refused.inc()
            log.warning(
                "not checkpointing version %d: %s; the checkpoint at version %d stays",
                version,
                self.health.problem or "workers' losses are diverging",
                self.good_version,
            )
            return
        try:
            served.save_checkpoint(
                {**held.checkpoint_fields(), "replay_marks": self.replays.saved(), "rollbacks": self.rollbacks}
            )
        except OSError as exc:
            if not out_of_descriptors(exc):
                raise
            log.warning(
                "checkpoint of version %d not written: %s; the one at version %d stays",
                version,
                exc.strerror,
                self.good_version,
            )
            return
        self.good_version = version
        served.metrics.checkpoints.inc()
        log.info("checkpoint at version %d written to %s", version, served.checkpoint_path)

    def roll_back(self, number: int, held: HeldModel) -> bool:
        """Restore the last good checkpoint (the scheduler's rollback `number`); True if the model went back.

        Workers whose pushes were computed on the diverged model are refused (their
        base version is ahead, ShardState.check_base) and pull again.
        """
        served, model = self.served, held.state
        self.rollbacks = number
        served.metrics.rollbacks.inc()
        try:
            saved = served.load_checkpoint()
        except (OSError, ValueError, RuntimeError) as exc:
            log.error(
                "rollback %d ordered, but the checkpoint cannot be read: %s; the model stays as it is", number, exc
            )
            return False
        if saved is None:
            log.error(
                "rollback %d ordered, but this shard has no checkpoint to go back to (--checkpoint-dir); "
                "the model stays as it is",
                number,
            )
            return False
        before = model.version
        held.roll_back(saved)
        self.judge_restored(model)
        log.warning(
            "rollback %d: restored version %d from %s (the model was at version %d); step size now x%g",
            number,
            model.version,
            served.checkpoint_path,
            before,
            model.step_size.job_factor,
        )
        return True
