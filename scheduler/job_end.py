"""When the job ends: its target reached and confirmed, its time budget spent, or a failure.

The end is a latch (`latch`, called after every change of what it depends on):
once workers have been told to stop they leave, so work lost afterwards (a
rollback, a shard back from an older checkpoint) cannot be trained again, and a
job waiting for it would wait for ever. For the same reason the job's epochs do
not count as reached while its model is in doubt: the samples trained meanwhile
may be thrown away by a rollback, which would otherwise end the job at the
restored model.
"""

from __future__ import annotations

from dynabatch.common.config import JobConfig
from dynabatch.scheduler.roster import Member
from dynabatch.scheduler.saved_progress import SavedProgress
from dynabatch.scheduler.stall import StallWatch, stall_limit_s


class JobEnd:
    """The end of the job: the stop latch and what it waits for, the budget, a stall, a failure, the final eval."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.stop_latched = False  # see `latch`
        self.trained_at_beats: dict[int, int] | None = None  # each shard's heartbeats when the epochs were reached
        self.budget_spent = False
        self.stall = StallWatch()
        self.failed = ""  # why the job gave up; a failed job stops as a finished one does
        self.stopped_at: float | None = None
        self.gave_up_on_final_eval = False
        self.dropped_evaluator = ""  # why the last evaluator dropped for making no progress was (`evaluator_dropped`)

    @property
    def stopping(self) -> bool:
        """The job's end has begun: its target reached, its budget spent, or it failed (as last latched)."""
        return self.stop_latched

    def latch(self, epoch: float, in_doubt: bool, shards: dict[int, Member]) -> None:
        """Begin the job's end if its target is reached and confirmed, its budget spent, or it failed; once begun
        it stays begun. `in_doubt`: the model diverged and is not yet rolled back (rollbacks.py)."""
        if not self.stop_latched:
            self.stop_latched = (
                self._trained_and_confirmed(epoch, in_doubt, shards) or self.budget_spent or bool(self.failed)
            )

    def _trained_and_confirmed(self, epoch: float, in_doubt: bool, shards: dict[int, Member]) -> bool:
        """The job's epochs are reached, and every shard has since reported its model healthy.

        Workers report the samples of pushes already applied, so a shard's heartbeat
        sent after the report that reached the epochs judges the model that holds
        them; the second heartbeat received after it surely was sent after it.
        """
        if in_doubt or epoch < self.job.epochs:
            self.trained_at_beats = None
            return False
        if self.trained_at_beats is None:
            self.trained_at_beats = {i: s.heartbeats for i, s in shards.items()}
        return all(s.heartbeats >= self.trained_at_beats.get(i, 0) + 2 for i, s in shards.items())

    def check_budget(self, now: float, training_started_at: float | None) -> None:
        """Stop the job once `time_budget_s` has passed since the first batches were handed out."""
        if self.job.time_budget_s > 0 and training_started_at is not None and not self.budget_spent:
            self.budget_spent = now - training_started_at >= self.job.time_budget_s

    def check_stall(self, now: float, samples: int, workers: list[Member], training_started: bool) -> None:
        """Fail a job that trains nothing for longer than its live `workers`' steps allow (stall.py)."""
        training = training_started and bool(workers) and not self.stopping
        still = self.stall.observe(samples, now, training)
        limit = stall_limit_s([m.last.times.step_s for m in workers], self.job.join_timeout_s)
        if training and still > limit:
            skipped = sum(m.last.skipped for m in workers)
            self.failed = (
                f"no sample trained for {still:.0f} s (limit {limit:.0f} s: the join timeout, or 50 of the "
                f"slowest worker's steps) while {len(workers)} worker(s) were live"
                + (f"; they skipped {skipped} steps whose loss was not finite" if skipped else "")
            )

    def fail(self, reason: str) -> None:
        """The job gives up (`reason` empty: it does not); the first reason stays."""
        if reason and not self.failed:
            self.failed = reason

    def wait_for_final_eval(self, now: float, evaluators: bool, final_eval: bool) -> bool:
        """Note when the job stopped; True once, when it gives up waiting for an evaluator to join (with
        `await_final_eval`, for up to `join_timeout_s` after it stopped)."""
        if self.stopping and self.stopped_at is None:
            self.stopped_at = now
        if (
            self.job.await_final_eval
            and not self.gave_up_on_final_eval
            and not final_eval
            and self.stopped_at is not None
            and not evaluators
            and now - self.stopped_at > self.job.join_timeout_s
        ):
            self.gave_up_on_final_eval = True
            return True
        return False

    def evaluator_dropped(self, why: str) -> None:
        """An evaluator was dropped for making no progress (`why`): a final evaluation it owed is given up."""
        self.dropped_evaluator = why

    def final_eval_given_up(self, finished: bool, final_eval: bool) -> str:
        """Why a finished job has no final evaluation although one was awaited: an evaluator that made no progress
        was dropped, or none joined in time; "" if it has one, was not done, failed, or awaited none."""
        if not finished or final_eval or self.failed:
            return ""
        if self.dropped_evaluator:
            return self.dropped_evaluator
        if self.gave_up_on_final_eval:
            return f"no evaluator joined within {self.job.join_timeout_s:.0f} s of the job's end"
        return ""

    def finished(self, workers_live: bool, evaluators: bool, final_eval: bool) -> bool:
        """Target reached, every worker gone, and the final model evaluated (if anyone evaluates).

        With `await_final_eval` a job stays unfinished while no evaluator is
        connected, for up to `join_timeout_s` after it stopped: a short job
        can reach its target before its evaluator has loaded the test set.
        """
        if not self.stopping or workers_live:
            return False
        if self.failed:
            return True  # a model that diverged or never trained is not worth a final evaluation
        if final_eval or evaluators:
            return final_eval
        return not self.job.await_final_eval or self.gave_up_on_final_eval

    def restore(self, saved: SavedProgress) -> None:
        """A saved job's spent budget (the latch follows at the next `latch`)."""
        self.budget_spent = saved.budget_spent
