"""The scheduler's view of one job, composed of one part per concern, without sockets.

Membership (roster.py), the batch split with its speed models and local steps
(allocator.py), progress in samples and epochs with lost work (progress.py),
divergence and its rollbacks (rollbacks.py), the latest evaluation
(evaluations.py), when each model version existed (version_times.py), the end
of the job (job_end.py) and the wire's schedule (wire_schedule.py) each hold their own state.
`JobState` takes each decoded message and the clock, hands them to the parts in
order, and answers; the server loop feeds it, tests drive it directly. Its
`saved` and `resume` carry the parts over a restart of the scheduler
(job_restart.py; the file, saved_progress.py), and its `status` reads them
all as STATUS (job_status.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dynabatch.common import staleness
from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.planning.protocol_switch import running, switch_plan, switches
from dynabatch.common.protocols import ProtocolSpec, dbs_weight, protocol_spec
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import (
    EvalReport,
    Hello,
    JobStatus,
    Role,
    ShardAssignment,
    ShardHeartbeat,
    Welcome,
    WorkerAssignment,
    WorkerHeartbeat,
)
from dynabatch.scheduler.allocator import Allocator
from dynabatch.scheduler.evaluations import Evaluations
from dynabatch.scheduler.job_end import JobEnd
from dynabatch.scheduler.job_restart import resume_job, saved_job
from dynabatch.scheduler.job_status import job_status
from dynabatch.scheduler.outage_clock import ClockReading
from dynabatch.scheduler.progress import Progress
from dynabatch.scheduler.progress_watch import measured_eval_s, progressed, stuck_workers, wedged_evaluators
from dynabatch.scheduler.protocol_in_force import ProtocolInForce
from dynabatch.scheduler.report_bounds import check_rollbacks, check_shard_heartbeat, check_worker_heartbeat
from dynabatch.scheduler.rollbacks import Rollbacks
from dynabatch.scheduler.roster import Member, Roster
from dynabatch.scheduler.saved_progress import SavedProgress
from dynabatch.scheduler.version_times import VersionTimes
from dynabatch.scheduler.wire_schedule import WireSchedule

log = logging.getLogger("dynabatch.scheduler")


class JobState:
    """The job: composes its parts, and orders what each message changes in them (no state of its own)."""

    def __init__(
        self,
        job: JobConfig,
        num_shards: int,
        train_size: int = 0,
        now: float | None = None,
        spec: ProtocolSpec | None = None,
    ) -> None:
        """`spec` replaces the protocol's own (bench/simulate.py tries variants of a protocol)."""
        self.job = job
        plan = switch_plan(job) if switches(job) else None
        self.protocol = ProtocolInForce(plan, num_shards) if plan is not None else None  # --protocol auto
        self.spec = spec or protocol_spec(job.protocol if plan is None else plan.start)
        self.roster = Roster(job, num_shards)
        self.allocator = Allocator(job, self.spec, plan.protocols if plan is not None else ())
        self.progress = Progress(job, self.roster, train_size, time.monotonic() if now is None else now)
        self.rollbacks = Rollbacks(job, self.roster)
        self.evaluations = Evaluations()
        self.version_times = VersionTimes()
        self.end = JobEnd(job)
        self.wire = WireSchedule(job, self.spec)

    # -- membership -------------------------------------------------------------

    def hello(
        self, hello: Hello, now: float, connection: bytes = b"", admit: Callable[[], None] = lambda: None
    ) -> Welcome:
        """Admit a process; shards take a slot, workers wait until every shard is there.

        The member is bound to `connection` (the ROUTER routing id it registered from):
        every later message in its name must come from there. The same process (same
        `instance`) may say HELLO again from a new connection and is rebound to it.
        `admit` is called just before a new member is made, and may refuse it by raising.
        """
        self.roster.check_hello(hello)
        again = self.roster.rebind(hello, now, connection)
        if again is not None:
            return self._welcome(again)
        if (self.stopping and hello.role == Role.WORKER) or (self.finished and hello.role == Role.EVALUATOR):
            raise ProtocolError(ErrorCode.JOB_OVER, "the job has reached its target and is stopping")
        member = self.roster.register(hello, now, connection, admit)
        self._latch()
        return self._welcome(member)

    def _welcome(self, member: Member) -> Welcome:
        return Welcome(
            id=member.id,
            config=to_dict(self.running_job),
            shards=self.roster.shard_endpoints(),
            shard_index=member.shard_index,
            number=member.number,
        )

    @property
    def running_job(self) -> JobConfig:
        """The job as its members run it now: under `--protocol auto`, the workers' protocol (a shard is told the
        chosen one by its assignment)."""
        return self.job if self.protocol is None else running(self.job, self.protocol.workers)

    def bye(self, member_id: str, now: float, connection: bytes = b"") -> bool:
        """Drop a member that leaves; False if it had already gone (a BYE sent again because its ack was slow)."""
        if self.roster.has_left(member_id):
            return False
        self._drop(self.roster.member(member_id, connection), now, "left")
        self._latch()
        return True

    def expire(self, now: float) -> list[str]:
        """Drop members whose heartbeats stopped, workers holding a batch whose steps stopped and evaluators
        whose evaluations stopped (progress_watch.py); returns their ids."""
        dead = self.roster.silent(now)
        for m in dead:
            log.warning("%s; dropped", self.roster.why_silent(m, now))
            self._drop(m, now, "heartbeat timeout")
        hold = self.roster.hold_news(now)
        if hold is not None:
            log.warning("%s", hold)
        started = self.allocator.training_started
        stuck = stuck_workers(self.roster.workers(), self.allocator.batch_of, now, self.job) if started else []
        for m, why in stuck:
            log.warning("%s: dropped from rounds and from the end of the job; it may register again", why)
            self._drop(m, now, "no progress")
        wedged = wedged_evaluators(self.roster.evaluators(), now, self.job)
        for m, why in wedged:
            log.warning("%s: dropped; the job's end does not wait for it", why)
            self.end.evaluator_dropped(why)
            self._drop(m, now, "no progress")
        self._latch()
        return [m.id for m in dead] + [m.id for m, _ in stuck + wedged]

    def _drop(self, member: Member, now: float, why: str) -> None:
        if member.role == Role.SHARD and self.roster.shards.get(member.shard_index) is member:
            self.allocator.forget_shard(member.shard_index)
            if self.protocol is not None:
                self.protocol.forget_shard(member.shard_index)
        if self.roster.leave(member):
            self.progress.worker_left(member)
        if member.role == Role.WORKER:
            self.rollbacks.forget(member.id)
            self.allocator.forget(member.id)
            self.wire.forget(member.id)
        if member.id in self.allocator.allocation:
            self._reallocate(now, why, member.id, force=True)
        self.roster.forget_departed()

    def _quarantine(self, workers: list[str], shard: str, now: float) -> None:
        """Drop the live workers a shard quarantined (their pushes kept exceeding the gradient bound, or kept
        pointing against the other workers'); their process may not register again (its HELLO.instance is
        refused)."""
        for wid in workers:
            member = self.roster.members.get(wid)
            if member is None or member.left or member.role != Role.WORKER:
                continue
            log.warning("%s quarantined by %s (its log says why); dropped", wid, shard)
            self.roster.quarantine(member)
            self._drop(member, now, "quarantined")

    # -- heartbeats ------------------------------------------------------------------

    def heartbeat(self, member_id: str, hb: WorkerHeartbeat, now: float, connection: bytes = b"") -> WorkerAssignment:
        """Record a worker's or an evaluator's heartbeat and answer with its current assignment."""
        member = self.roster.reporting(member_id, connection, shard=False)
        self.end.check_budget(now, self.allocator.training_started_at)
        if member.role == Role.WORKER:
            # A local round's steps are reported at its end, after heartbeats that repeated the old counters:
            # they fit in the time since the counters last grew, not since the last heartbeat.
            check_worker_heartbeat(
                member.last, hb, now - (member.progress_at or member.joined), self.job.max_batch, self.roster.num_shards
            )
            check_rollbacks(hb, self.job.max_rollbacks)
            if progressed(member.last, hb) or not member.progress_at:
                member.progress_at = now
            if not member.admitted_in and hb.standalone_sps > 0:
                # Its first report (a worker heartbeats from its WELCOME on, while it loads and measures itself,
                # and is counted in n only once ready): from now on it is live, and every shard must learn it.
                self.roster.admit_worker(member)
            self._worker_heartbeat(member, hb, now)
            self.rollbacks.worker_report(member.id, member.last, hb)
        member.heard(now)
        member.heartbeats += 1
        member.last = hb
        self._judge_divergence(now)
        answer = self.assignment_for(member)
        if member.role == Role.WORKER:
            self.allocator.hand(member.id, answer.batch)
        return answer

    def shard_heartbeat(
        self, member_id: str, hb: ShardHeartbeat, now: float, connection: bytes = b""
    ) -> ShardAssignment:
        """Record a shard's heartbeat and answer with what it must know of the job."""
        member = self.roster.reporting(member_id, connection, shard=True)
        prev = member.shard_last
        self.end.check_budget(now, self.allocator.training_started_at)
        check_shard_heartbeat(hb, self.job.max_rollbacks, self.job.max_batch)
        member.heard(now)
        member.heartbeats += 1
        member.shard_last = hb
        self.progress.shard_report(member.shard_index, hb)
        given = {w: now - self.roster.members[w].batch_given_at for w in hb.pushed if w in self.roster.members}
        self.allocator.shard_reported(member.shard_index, hb, given)
        self.version_times.observe(self.roster.model_version(), self.progress.t(now))
        if hb.batches is not None:  # what it applied, of members known here only (a forged list holds no memory)
            self.allocator.tell(member.shard_index, {w: b for w, b in hb.batches.items() if w in self.roster.members})
        self._quarantine(hb.quarantined, member.id, now)
        if self.protocol is not None:
            self._protocol_report(member.shard_index, hb, now)
        self.rollbacks.shard_report(member.shard_index, prev, hb)
        waiting = [
            m.id for m in self._ready_workers(known_to_shards=False).values() if m.id not in self.allocator.allocation
        ]
        if waiting and self.roster.known_to_shards(self.roster.members[waiting[0]]):
            self._reallocate(now, "joined", waiting[0], force=True)
        elif self.allocator.choosing_on_probes():
            self._reallocate(now, "shard load", member.id)
        self._judge_divergence(now)
        answer = self.shard_assignment()
        self.allocator.answered(member.shard_index)
        return answer

    def _judge_divergence(self, now: float) -> None:
        """After a report: fail the job if its rollbacks are spent (rollbacks.py), and latch its end if it came."""
        if not self.end.failed:
            self.end.fail(self.rollbacks.react(self.progress.t(now), self.progress.epoch))
        self._latch()

    def _worker_heartbeat(self, member: Member, hb: WorkerHeartbeat, now: float) -> None:
        bad_counts = staleness.check(hb.staleness)
        if bad_counts:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"HEARTBEAT.staleness: {bad_counts}")
        new_steps = hb.steps - member.steps
        member.steps, member.samples = hb.steps, hb.samples
        self.allocator.stepped(member.id, hb.assignment_id)
        self.allocator.idled.report(member.id, hb.steps, hb.discarded)
        measured = member.id in self.allocator.speeds
        if not measured and hb.standalone_sps > 0:
            member.standalone_sps, member.standalone_fixed_s = hb.standalone_sps, hb.standalone_fixed_s
            self.allocator.measure(
                member.id, hb.standalone_sps, member.instance, hb.standalone_fixed_s, member.max_batch
            )
            measured = True
            self._reallocate(now, "joined", member.id, force=True)
        if new_steps > 0 and hb.batch > 0 and hb.times.step_s > 0 and measured:
            self.allocator.observe(member.id, hb)
            plan = self.wire.observe(member.id, member.last, hb)
            if plan is not None:
                log.info("%s sends its gradient by a new plan: %s", member.id, plan.reason)
            member.count_steps(hb, new_steps)
            self.progress.observe_loss(hb.loss)
            self._reallocate(now, "speed update", member.id)
            if self.spec.adaptive_local_steps:
                live = [self.roster.members[w].last for w in self.roster.live_workers]
                self.allocator.adapt_local_steps(self.progress.t(now), self.progress.loss, live)

    def eval_report(self, member_id: str, report: EvalReport, now: float, connection: bytes = b"") -> None:
        """Keep the newest evaluation (evaluations.py). Only an evaluator reports one; anything else is refused
        and changes nothing."""
        member = self.roster.member(member_id, connection)
        if member.role != Role.EVALUATOR:
            raise ProtocolError(
                ErrorCode.BAD_SENDER, f"{member_id} is a {member.role}; only an evaluator reports evaluations"
            )
        self.evaluations.check(report, self.progress.newest_possible_version)
        member.heard(now)
        member.eval_s = measured_eval_s(
            member.eval_s,
            now - (member.progress_at or member.joined),
            self.job.eval_interval_s,
            first=not member.progress_at,
        )
        member.progress_at = now
        t = self.progress.t(now)
        self.evaluations.keep(
            report,
            t,
            self.roster.newest_shard_version(),
            self.rollbacks.rollback_done,
            self.stopping,
            model_t=self.version_times.time_of(report.version, t),
        )
        self._latch()

    # -- allocation ------------------------------------------------------------------

    def _ready_workers(self, known_to_shards: bool) -> dict[str, Member]:
        """Workers that can take a batch: measured, and (for a first batch) known to every shard."""
        allocator = self.allocator
        return {
            m.id: m
            for m in self.roster.workers()
            if m.id in allocator.speeds
            and (not known_to_shards or m.id in allocator.allocation or self.roster.known_to_shards(m))
        }

    def _allot(self, member: Member) -> None:
        """Allot `member` its share of the samples the job has yet to train (allocator.py), once the training set's
        size is known."""
        budget = self.progress.budget
        if budget is not None:
            workers = self.roster.workers()
            self.allocator.allot(
                member.id,
                {m.id: m.samples for m in workers},
                {m.id: m.steps for m in workers},
                budget - self.progress.departed_samples,
            )

    def _reallocate(self, now: float, reason: str, subject: str, force: bool = False) -> None:
        """Re-solve the batch split (allocator.py); a worker given a batch after holding none is judged from now."""
        ready = {wid: m.max_batch for wid, m in self._ready_workers(known_to_shards=True).items()}
        for wid in self.allocator.reallocate(now, self.progress.t(now), reason, subject, ready, force):
            self.roster.members[wid].batch_given_at = now
        auto = self.allocator.auto
        if self.protocol is not None and auto is not None and self.protocol.choose(auto.protocol):
            log.info(
                "protocol auto chose %s: the shards switch first, then the workers (%s)", auto.protocol, auto.reason
            )

    def _protocol_report(self, shard: int, hb: ShardHeartbeat, now: float) -> None:
        """A shard's word on `--protocol auto`'s switch: the protocol it applies, or one it cannot run."""
        assert self.protocol is not None
        if self.protocol.refused(shard, hb.refused_protocol) and self.allocator.auto is not None:
            log.warning("shard %d cannot run %s; protocol auto chooses among the others", shard, hb.refused_protocol)
            self.allocator.auto.leave_out(hb.refused_protocol, self.protocol.workers)
        if self.protocol.shard_report(shard, hb.protocol):
            self.follow_workers_protocol(now)

    def follow_workers_protocol(self, now: float) -> None:
        """Every shard applies the chosen protocol (or a restarted scheduler resumed it): the workers step under it
        from the next assignment, and the scheduler decides for it (its split, allotments and schedule follow the
        new spec)."""
        assert self.protocol is not None
        spec = protocol_spec(self.protocol.workers)
        self.spec = self.wire.spec = spec
        self.allocator.switch(spec, {m.id: m.steps for m in self.roster.workers()})
        if self.allocator.auto is not None:
            self.allocator.auto.protocol = spec.name
        self._reallocate(now, f"protocol {spec.name}", "auto", force=True)
        self.protocol.since = self.allocator.assignment_id
        log.info("every shard applies %s: the workers switch from assignment %d", spec.name, self.protocol.since)

    @property
    def job_progress(self) -> float:
        """How far the job is, epoch / epochs in [0, 1] (0 for a job without epochs): where the task's schedule
        stands, for the shards' steps and a delta protocol's workers' inner steps alike."""
        return min(1.0, self.progress.epoch / self.job.epochs) if self.job.epochs else 0.0

    def shard_assignment(self) -> ShardAssignment:
        """What every shard must know of the job now: its live workers and their push bounds, rollbacks, the stop."""
        allocator, rollbacks, live = self.allocator, self.rollbacks, self.roster.live_workers
        return ShardAssignment(
            live_workers=live,
            allocated=allocator.holding_batch,
            idle_workers=allocator.idle_workers(),
            membership=self.roster.membership,
            stop=self.finished,
            batches=allocator.push_bounds(live),
            progress=self.job_progress,
            rollbacks=rollbacks.rollback_number,
            lr_factor=rollbacks.lr_factor,
            hold_checkpoints=rollbacks.divergence.suspect,
            serve_ranks=self.wire.ranks(live),
            protocol=self.protocol.chosen if self.protocol is not None else "",
        )

    def assignment_for(self, member: Member) -> WorkerAssignment:
        """What worker or evaluator `member` should do now; a worker is allotted its share of the samples left to
        train."""
        allocator, rollbacks = self.allocator, self.rollbacks
        if member.role == Role.EVALUATOR:
            return WorkerAssignment(
                assignment_id=allocator.assignment_id, stop=self.stopping and not self.roster.live_workers
            )
        self._allot(member)
        batch, plan = allocator.batch_of(member.id), self.wire.plan_of(member.id)
        scale = dbs_weight(batch, self.job.global_batch, allocator.holding_batch, self.job.dbs_weight)
        return WorkerAssignment(
            assignment_id=allocator.assignment_id,
            batch=batch,
            lr_scale=scale * rollbacks.lr_factor,
            stop=self.stopping,
            local_steps=allocator.local_steps,
            rollbacks=rollbacks.rollback_done,
            allotted=allocator.allotted.get(member.id),
            chunk_group=plan.group,
            credit_bytes=plan.credit,
            protocol=self.protocol.workers if self.protocol is not None else "",
            progress=self.job_progress,
        )

    # -- the end of the job -------------------------------------------------------------

    def _latch(self) -> None:
        """Begin the job's end if it has come (job_end.py); called after every change of what it depends on."""
        self.end.latch(self.progress.epoch, self.rollbacks.in_doubt, self.roster.shards)

    @property
    def stopping(self) -> bool:
        """The job's end has begun (a latch: job_end.py)."""
        return self.end.stopping

    @property
    def finished(self) -> bool:
        """Target reached, every worker gone, and the final model evaluated (if anyone evaluates)."""
        return self.end.finished(
            bool(self.roster.live_workers), bool(self.roster.evaluators()), self.evaluations.final_eval
        )

    def tick(self, now: float) -> bool:
        """The clock's part of the job's end: the time budget, a stall, and how long a final evaluation is awaited.

        Returns True once, when the job gives up waiting for an evaluator to join.
        """
        self.end.check_budget(now, self.allocator.training_started_at)
        self._latch()
        workers = [self.roster.members[w] for w in self.roster.live_workers]
        self.end.check_stall(now, self.progress.samples, workers, self.allocator.training_started)
        self._latch()
        return self.end.wait_for_final_eval(now, bool(self.roster.evaluators()), self.evaluations.final_eval)

    # -- reporting ------------------------------------------------------------------

    def status(self, now: float) -> JobStatus:
        """The job as `dynabatch run` and operators see it (job_status.py; the server adds its decision latency)."""
        return job_status(self, now)

    # -- restart ------------------------------------------------------------------------

    def saved(self, now: float, wall: ClockReading) -> SavedProgress:
        """What a restarted scheduler needs to go on with this job (job_restart.py); `wall` is read_clock()."""
        return saved_job(self, now, wall)

    def resume(self, saved: SavedProgress, now: float, wall: ClockReading) -> None:
        """Go on from `saved` (job_restart.py): its samples count as trained by workers that left, every process
        registers anew, and the job's clock goes on through the outage."""
        resume_job(self, saved, now, wall)
        self._latch()
