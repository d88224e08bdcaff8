"""A job carried over a restart of the scheduler: what its parts save, and how they go on from it.

Every part of `JobState` that holds something no other process can tell a restarted
scheduler again gives it to one `SavedProgress` (saved_progress.py, the file's format)
and takes it back from there. Members are not saved: every process registers again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynabatch.common.config import to_dict
from dynabatch.scheduler.outage_clock import ClockReading, outage_s
from dynabatch.scheduler.roster import finite_or_none
from dynabatch.scheduler.saved_progress import SavedProgress

if TYPE_CHECKING:
    from dynabatch.scheduler.job_state import JobState


def saved_job(state: JobState, now: float, wall: ClockReading) -> SavedProgress:
    """What a restarted scheduler needs to go on with `state`'s job at `now`; `wall` is read_clock()."""
    progress, allocator, evaluations = state.progress, state.allocator, state.evaluations
    started = allocator.training_started_at
    measured = {
        m.instance: (m.id, m.standalone_sps)
        for m in state.roster.members.values()
        if m.instance and not m.left and m.id in allocator.speeds
    }
    return SavedProgress(
        config=to_dict(state.job),
        saved_at=wall.wall,
        saved_boot_id=wall.boot_id,
        saved_boot_s=wall.boot_s,
        t=progress.t(now),
        samples=progress.samples,
        lost_samples=progress.lost_samples,
        lost_versions=progress.lost_versions,
        train_size=progress.train_size,
        training_s=None if started is None else now - started,
        assignment_id=allocator.assignment_id,
        next_id=dict(state.roster.next_id),
        local_steps=allocator.local_steps,
        local_steps_reason=allocator.local_steps_reason,
        loss=finite_or_none(progress.loss),
        first_loss=allocator.first_loss,
        eval=evaluations.eval,
        eval_time=evaluations.eval_time,
        eval_model_time=evaluations.eval_model_time,
        final_eval=evaluations.final_eval,
        budget_spent=state.end.budget_spent,
        shard_marks=dict(progress.shard_marks),
        speeds=allocator.saved_speeds(measured),
        rollbacks=list(state.rollbacks.rollbacks),
        protocol=state.protocol.workers if state.protocol is not None else "",
    )


def resume_job(state: JobState, saved: SavedProgress, now: float, wall: ClockReading) -> None:
    """Go on from `saved`: its samples count as trained by workers that left, every process registers anew.

    The job's clock goes on through the outage (from the save to `wall`, read_clock(): never negative, and
    bounded where a wall clock that may have jumped is all there is; outage_clock.py): time to accuracy and
    the time budget are what the user waited, restarts included. The saved samples are checked against the
    shards' own counts once every shard has reported (progress.py).
    """
    down = (
        0.0
        if saved.saved_at is None
        else outage_s(ClockReading(saved.saved_at, saved.saved_boot_id, saved.saved_boot_s), wall)
    )
    now -= down
    state.progress.restore(saved, now)
    state.allocator.restore(saved, None if saved.training_s is None else now - saved.training_s)
    state.roster.next_id.update(saved.next_id)
    state.evaluations.restore(saved)
    state.rollbacks.restore(saved)
    state.end.restore(saved)
    if state.protocol is not None and state.protocol.resume(saved.protocol):
        state.follow_workers_protocol(now)  # --protocol auto goes on under the protocol it had switched to
