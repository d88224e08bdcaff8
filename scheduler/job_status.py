"""STATUS: the job as `dynabatch run` and operators see it, read from every part of `JobState`.

A view, not a decision: each figure is its part's (roster.py, allocator.py,
progress.py, rollbacks.py, evaluations.py, job_end.py, wire_schedule.py), and a
worker's batch is the allocator's, as its assignment's is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from dynabatch.common.wire.messages import DepartedWorker, JobStatus, Role, ShardStatus
from dynabatch.scheduler.roster import finite_or_none

if TYPE_CHECKING:
    from dynabatch.scheduler.job_state import JobState


def job_status(state: JobState, now: float) -> JobStatus:
    """`state`'s job as `dynabatch run` and operators see it at `now` (the server adds its decision latency)."""
    ev, progress, allocator, rollbacks = state.evaluations.eval, state.progress, state.allocator, state.rollbacks
    started = allocator.training_started_at
    return JobStatus(
        t=progress.t(now),
        job=state.job.job,
        protocol=state.running_job.protocol,
        batch_policy=state.job.batch_policy,
        epoch=progress.epoch,
        target_epochs=state.job.epochs,
        samples=progress.samples,
        lost_samples=progress.lost_samples,
        lost_versions=progress.lost_versions,
        bytes=progress.bytes,
        staleness=progress.staleness_counts,
        training_t=None if started is None else now - started,
        budget_spent=state.end.budget_spent,
        local_steps=allocator.local_steps,
        local_steps_reason=allocator.local_steps_reason,
        loss=finite_or_none(progress.loss),
        test_acc=finite_or_none(ev.test_acc) if ev else None,
        test_loss=ev.test_loss if ev else None,
        metrics=dict(ev.metrics) if ev else {},
        train_size=progress.train_size,
        eval_version=ev.version if ev else None,
        eval_t=state.evaluations.eval_time if ev else None,
        eval_model_t=state.evaluations.eval_model_time if ev else None,
        stopping=state.stopping,
        finished=state.finished,
        final_eval=state.evaluations.final_eval,
        final_eval_given_up=state.end.final_eval_given_up(state.finished, state.evaluations.final_eval),
        assignment_id=allocator.assignment_id,
        workers={
            m.id: state.wire.shown(
                m.id, m.public(allocator.batch_of(m.id), allocator.idled.reason(m.id)), state.roster.live_workers
            )
            for m in state.roster.workers()
        },
        departed={
            m.id: DepartedWorker(m.name, m.steps, m.samples, m.last.discarded)
            for m in sorted(state.roster.members.values(), key=lambda m: m.id)
            if m.role == Role.WORKER and m.left
        },
        shards={
            str(i): ShardStatus(
                m.endpoint,
                m.shard_last.version,
                m.metrics_url,
                m.shard_last.discarded,
                m.shard_last.model_problem,
                m.shard_last.good_version,
                m.shard_last.busy_s,
                m.shard_last.queued_s,
                m.shard_last.busy_sq_s,
                m.shard_last.served,
                m.shard_last.transfers,
                len(set(m.shard_last.pushed) & set(state.roster.live_workers)),
            )
            for i, m in sorted(state.roster.shards.items())
        },
        decisions=allocator.decisions[-10:],
        rollbacks=[replace(r, versions=dict(r.versions)) for r in rollbacks.rollbacks],
        lr_factor=rollbacks.lr_factor,
        failed=state.end.failed,
        unallotted=allocator.unallotted,
        auto_policy=allocator.auto.policy if allocator.auto else "",
        auto_reason=allocator.auto.reason if allocator.auto else "",
        auto_protocol=state.protocol.chosen if state.protocol else "",
        auto_protocol_reason=state.protocol.reason(allocator.auto.reason if allocator.auto else "")
        if state.protocol
        else "",
    )
