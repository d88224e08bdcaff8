"""What a worker reports to the scheduler, and when.

After a step it reports its cumulative counters and the step's per-step phase
times (`heartbeat_after`): the worker (trainer.py) and the virtual-time
simulator (bench/simulate.py) both build their heartbeats there, so the
scheduler's speed model is fed the same figures by both. Between steps, while
it waits on shards or inside a long round, it repeats its last heartbeat
(`HeartbeatKeeper`), and hears early that the scheduler dropped it, that the
job rolled back, or that the process was told to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynabatch.common.net.scheduler_link import SchedulerLink
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.messages import Error, WorkerAssignment, WorkerHeartbeat
from dynabatch.worker.step_result import StepResult


class NeverAdmitted(RuntimeError):
    """The scheduler refused this worker's start-up report (`never_admitted`): the process exits with an error, and
    `dynabatch run` starts it again (cluster/restart_policy.py), with a probe of its own again."""


def never_admitted(refused: Error | None, hb: WorkerHeartbeat) -> str | None:
    """Why a worker waiting for its first batch must exit, or None. Before its first step its report is its start-up
    probe (`standalone_sps`, `standalone_fixed_s`), repeated unchanged while it waits: where the scheduler refused
    it as out of bounds (`refused`, the answer to its last report), every repeat is refused alike and the worker is
    never admitted, a job waiting for it never starts, and only its log says why (two suites side by side stalled
    a probe so, bench/RESULTS.md 63). A worker that has stepped reports counters that grow, and a refusal of one
    report is not one of the next."""
    if refused is None or refused.code != ErrorCode.BAD_FIELD or hb.steps:
        return None
    return (
        f"the scheduler refused this worker's start-up report ({refused.text}), so it would never be admitted; "
        "exiting, to be started again with a new probe"
    )


def heartbeat_after(
    prev: WorkerHeartbeat,
    result: StepResult,
    *,
    sync_s: float = 0.0,
    moved_bytes: int = 0,
    staleness: list[int] | None = None,
    assignment_id: int = 0,
    skipped: int = 0,
    rollbacks: int = 0,
    discarded: int = 0,
) -> WorkerHeartbeat:
    """`prev`'s counters plus `result`; phase times per local step (a round of H steps reports H)."""
    steps = result.steps
    return WorkerHeartbeat(
        steps=prev.steps + steps,
        samples=prev.samples + result.batch * steps,
        batch=result.batch,
        times=result.times.per_step(steps),
        sync_s=sync_s,
        bytes=moved_bytes,
        loss=result.loss,
        staleness=list(staleness or []),
        version=result.version,
        standalone_sps=prev.standalone_sps,
        standalone_fixed_s=prev.standalone_fixed_s,
        assignment_id=assignment_id,
        skipped=skipped,
        rollbacks=rollbacks,
        discarded=discarded,
    )


class Stopping(Exception):
    """The process was told to stop (SIGTERM, Ctrl-C) while it waited on shards or computed a long round.

    What it waited for no longer matters: a shard that is gone (the run's own shard
    died of a full disk) would otherwise hold the process for a whole request
    timeout, past `dynabatch run`'s or Kubernetes' grace period and into SIGKILL.
    """


class HeartbeatKeeper:
    """The last heartbeat this process sent, when the next is due, and the last rollback it acted on.

    `rollbacks` is None until the process trains (an evaluator never does): only
    then does a rollback end what it waits for. `interval_s` is the job's
    heartbeat interval, known once the process has joined. `stopping` says
    whether the process was told to stop.
    """

    def __init__(
        self,
        link: SchedulerLink[WorkerHeartbeat, WorkerAssignment],
        tick: Callable[[], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.link = link
        self.tick = tick  # the process's liveness (/healthz)
        self.stopping = stopping
        self.interval_s = 0.5
        self.last = WorkerHeartbeat()
        self.next_at = 0.0
        self.rollbacks: int | None = None

    def send(self, hb: WorkerHeartbeat) -> None:
        """Report `hb` now; the next report is due an interval from now."""
        self.link.heartbeat(hb)
        self.last = hb
        self.next_at = time.monotonic() + self.interval_s

    def repeat(self) -> None:
        """Repeat the last heartbeat (its counters are cumulative, so nothing is counted twice).

        Raises RemoteError once the scheduler has dropped this process, so that a
        wait for shards that refuse it ends now and it registers again; and once
        the job has rolled back while it trains, so that a wait for a version the
        shards threw away (a synchronous round's) ends now too. Raises Stopping,
        before anything is sent, once the process was told to stop.
        """
        if self.stopping():
            raise Stopping("stopped while waiting for the shards or inside a round")
        assignment = self.link.heartbeat(self.last)
        self.next_at = time.monotonic() + self.interval_s
        self.tick()
        if self.link.lost:
            raise RemoteError(ErrorCode.UNKNOWN_SENDER, "the scheduler has dropped this worker")
        if self.rollbacks is not None and assignment is not None and assignment.rollbacks > self.rollbacks:
            raise RemoteError(
                ErrorCode.ROLLED_BACK,
                f"the job rolled back (rollback {assignment.rollbacks}); the model "
                "this step waits for or computed on was thrown away",
            )

    def when_due(self) -> None:
        """Between progress reports, hear early whether the scheduler dropped this process (raises RemoteError).

        A local round of H steps, or an evaluation of 10k images, can last long;
        the pulse (pulse.py) keeps the process alive meanwhile, and this ends a
        round that the shards would refuse anyway.
        """
        if time.monotonic() >= self.next_at:
            self.repeat()
