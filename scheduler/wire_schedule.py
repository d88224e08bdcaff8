"""The wire's schedule: each worker's chunks per push and credit, and the order shards serve workers in.

With `--chunk-schedule fixed` every worker sends one chunk per PUSH within the
job's `--max-inflight-bytes`, and shards serve by chunk id alone, as the papers'
reproductions assume. With `scheduled`, every step a worker reports proposes a
plan (chunk_schedule.py) and the plan handed out follows it with hysteresis, and
shards are told each live worker's serving rank (serving_priority.py). This part
owns both; assignments, STATUS and the metrics read them here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import ProtocolSpec
from dynabatch.common.wire.messages import WorkerHeartbeat, WorkerStatus
from dynabatch.scheduler.allocator import own_step_seconds
from dynabatch.scheduler.chunk_schedule import STABLE_PROPOSALS, StepSample, WirePlan, plan_for, settle
from dynabatch.scheduler.serving_priority import WorkerTimes, serving_ranks


@dataclass
class WireSchedule:
    """Per worker: the plan handed out, the recent proposals, and its last step's times (for the ranks)."""

    job: JobConfig
    spec: ProtocolSpec
    plans: dict[str, WirePlan] = field(default_factory=dict)
    proposals: dict[str, list[WirePlan]] = field(default_factory=dict)
    times: dict[str, WorkerTimes] = field(default_factory=dict)

    @property
    def scheduled(self) -> bool:
        return self.job.chunk_schedule == "scheduled"

    def observe(self, worker: str, prev: WorkerHeartbeat, hb: WorkerHeartbeat) -> WirePlan | None:
        """A step `worker` reported (`hb`, after `prev`); returns its new plan when this step changed it."""
        steps = hb.steps - prev.steps
        if not self.scheduled or steps <= 0 or hb.bytes < prev.bytes:
            return None
        transfer = hb.times.pull_s + hb.times.push_s
        self.times[worker] = WorkerTimes(own_step_seconds(hb), transfer)
        sample = StepSample(hb.times.compute_s, transfer, (hb.bytes - prev.bytes) // steps)
        proposals = self.proposals.setdefault(worker, [])
        proposals.append(plan_for(sample, self.job.chunk_bytes, 0, self.job.max_inflight_bytes))
        del proposals[:-STABLE_PROPOSALS]
        plan = settle(self.plans.get(worker), proposals)
        if plan is not None:
            self.plans[worker] = plan
        return plan

    def forget(self, worker: str) -> None:
        for kept in (self.plans, self.proposals, self.times):
            kept.pop(worker, None)

    def plan_of(self, worker: str) -> WirePlan:
        """What `worker` sends by: its plan, or the job's fixed one (one chunk per push, the job's credit)."""
        return self.plans.get(worker) or WirePlan(1, self.job.max_inflight_bytes, "fixed by the job's flags")

    def ranks(self, live: list[str]) -> dict[str, int]:
        """Each live worker's serving rank for the shards (none under `fixed`: by chunk id alone)."""
        if not self.scheduled:
            return {}
        measured = {w: self.times[w] for w in live if w in self.times}
        return serving_ranks(measured, self.spec.closes_rounds)

    def shown(self, worker: str, status: WorkerStatus, live: list[str]) -> WorkerStatus:
        """`status` with `worker`'s plan and rank (-1: none) as STATUS shows them."""
        plan = self.plan_of(worker)
        return replace(
            status,
            chunk_group=plan.group,
            credit_bytes=plan.credit,
            wire_reason=plan.reason,
            serve_rank=self.ranks(live).get(worker, -1),
        )
