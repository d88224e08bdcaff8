"""What a worker reports after a step: its cumulative counters and the step's per-step phase times.

The worker (trainer.py) and the virtual-time simulator (bench/simulate.py) both
build their heartbeats here, so the scheduler's speed model is fed the same
figures by both.
"""

from __future__ import annotations

from dynabatch.common.messages import Heartbeat
from dynabatch.worker.step_times import StepResult


def heartbeat_after(
    prev: Heartbeat, result: StepResult, *, sync_s: float = 0.0, moved_bytes: int = 0,
    staleness: list[int] | None = None, assignment_id: int = 0, skipped: int = 0, rollbacks: int = 0,
) -> Heartbeat:
    """`prev`'s counters plus `result`; phase times per local step (a round of H steps reports H)."""
    times, steps = result.times, result.steps
    return Heartbeat(
        steps=prev.steps + steps, samples=prev.samples + result.batch * steps, batch=result.batch,
        step_s=times.total / steps, compute_s=times.compute / steps, pull_s=times.pull / steps,
        push_s=times.push / steps, wait_s=times.wait / steps, data_s=times.data / steps, sync_s=sync_s,
        bytes=moved_bytes, loss=result.loss, staleness=list(staleness or []), version=result.version,
        standalone_sps=prev.standalone_sps, assignment_id=assignment_id, skipped=skipped, rollbacks=rollbacks,
    )
