"""Everything the scheduler knows and decides, without sockets.

Membership (who is in the job, who stopped answering), each worker's speed
model, the batch allocation with its hysteresis, progress in epochs counted
from samples, the latest evaluation, divergence and its rollbacks, a stall, and
the end of the job. The server loop feeds it decoded messages and the clock; tests drive it directly.
"""

from __future__ import annotations

import logging

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from dynabatch.common import staleness
from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.eval_bounds import eval_problem
from dynabatch.common.messages import (
    Assignment, Decision, EvalReport, Heartbeat, Hello, JobStatus, Rollback, ShardStatus, Welcome, WorkerStatus,
)
from dynabatch.common.protocols import dbs_weight, protocol_spec
from dynabatch.common.wire import ProtocolError
from dynabatch.scheduler.batch_allocation import (
    allocation_for, bounds_note, fixed_allocation, needs_reassign,
)
from dynabatch.scheduler.divergence import DivergenceWatch, lr_factor
from dynabatch.scheduler.local_steps import adacomm_steps
from dynabatch.scheduler.lost_work import LostWork, ShardMark, lost_work
from dynabatch.scheduler.outage_clock import ClockReading, outage_s
from dynabatch.scheduler.progress_watch import stalled
from dynabatch.scheduler.report_bounds import (
    check_eval_version, check_rollbacks, check_shard_heartbeat, check_worker_heartbeat,
)
from dynabatch.scheduler.saved_progress import SavedProgress, SavedSpeed
from dynabatch.scheduler.speed_model import SpeedModel
from dynabatch.scheduler.stall import StallWatch, stall_limit_s

log = logging.getLogger("dynabatch.scheduler")
DECISIONS_KEPT = 100
LOSSES_KEPT = 100  # shard restarts not yet logged by the server
DEPARTED_KEPT = 1000  # members that left, kept for STATUS; older ones are forgotten (their counts stay)
MAX_INSTANCE_CHARS = 64
LOSS_SMOOTHING = 0.9


MIN_OWN_STEP_S = 1e-6
MAX_TRAIN_SIZE = 1 << 40
LIVENESS_STEPS = 3  # steps of its own measured length a worker may be silent before it is dropped


@dataclass
class Member:
    """One registered process and what its heartbeats told us."""

    id: str
    role: str
    name: str
    host: str
    metrics_url: str
    joined: float
    last_seen: float
    endpoint: str = ""
    progress_at: float = 0.0  # when its counters last grew: the steps a report adds were taken since then
    batch_given_at: float = 0.0  # when it was last given a batch after holding none (progress is judged from then)
    shard_index: int = -1
    speed: SpeedModel | None = None
    standalone_sps: float = 0.0
    steps: int = 0
    samples: int = 0
    last: Heartbeat = field(default_factory=Heartbeat)
    step_s_total: float = 0.0
    data_s_total: float = 0.0
    observed_steps: int = 0
    compute_s_total: float = 0.0
    observed_samples: int = 0
    heartbeats: int = 0
    left: bool = False
    admitted_in: int = 0  # the membership number that first held this worker
    connection: bytes = b""  # the ROUTER routing id of the connection that registered it
    instance: str = ""
    max_batch: int = 0  # the worker's own largest batch (HELLO), 0: none
    told_batches: dict[str, int] | None = None  # a shard: the push bounds (Assignment.batches) last sent to it

    @property
    def progress_since(self) -> float:
        """When its progress is judged from: its last new step, or the batch it was given after holding none."""
        return max(self.progress_at, self.batch_given_at)

    def public(self, batch: int) -> WorkerStatus:
        """The member as STATUS shows it, holding `batch` (the job's allocation owns a worker's batch)."""
        hb = self.last
        return WorkerStatus(
            role=self.role, name=self.name, host=self.host, metrics_url=self.metrics_url,
            joined=self.joined, steps=self.steps, samples=self.samples, batch=batch,
            step_s=hb.step_s, compute_s=hb.compute_s, pull_s=hb.pull_s, push_s=hb.push_s,
            wait_s=hb.wait_s, data_s=hb.data_s, samples_per_s=hb.batch / hb.step_s if hb.step_s > 0 else 0.0,
            standalone_sps=self.standalone_sps, loss=_finite_or_none(hb.loss),
            step_s_total=self.step_s_total, observed_steps=self.observed_steps,
            compute_s_total=self.compute_s_total, observed_samples=self.observed_samples,
            version=hb.version, updates=hb.updates, endpoint=self.endpoint,
            data_s_total=self.data_s_total, max_batch=self.max_batch,
        )


def own_step_seconds(hb: Heartbeat) -> float:
    """The part of a worker's step its speed model fits: everything but waiting for other workers.

    Waiting for others (an ssgd round, a local average) says nothing about the
    worker's speed, and fitting it would make every worker in a round look as
    slow as the slowest. Waiting for data (`data_s`) is the worker's own: a
    starved loader makes that machine slower at every batch size, exactly as a
    slow GPU does, so it stays in, and a worker whose loader cannot keep up gets
    a smaller share.
    """
    return max(hb.step_s - hb.wait_s, MIN_OWN_STEP_S)


def silence_allowed(member: Member, liveness_timeout_s: float, join_timeout_s: float) -> float:
    """Seconds of silence after which `member` is dropped as dead.

    A worker or evaluator heartbeats from a thread from its WELCOME on, however
    long it loads or computes (worker/pulse.py), so one that registered and never
    heartbeat is a ghost and goes after the liveness timeout. A shard restores its
    checkpoint before its first heartbeat (which reports the version it holds), so
    it has the join timeout for that. Once a worker reports steps, the margin also
    follows its own measured step time (capped by the join timeout, so no report
    can buy unlimited silence): a worker whose process is paused or starved for a
    few of its steps is not dropped.
    """
    if member.heartbeats == 0 and member.role == "ps":
        return max(liveness_timeout_s, join_timeout_s)
    by_steps = min(LIVENESS_STEPS * member.last.step_s, join_timeout_s)
    return max(liveness_timeout_s, by_steps)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class JobState:
    """The scheduler's view of one job."""

    def __init__(self, job: JobConfig, num_shards: int, train_size: int = 0, now: float | None = None) -> None:
        self.job = job
        self.spec = protocol_spec(job.protocol)
        self.local_steps = job.local_steps
        self.local_steps_reason = "configured H"
        self.first_loss = math.nan
        self.training_started = False
        self.departed_bytes = 0
        self.departed_staleness: list[int] = []
        self.training_started_at: float | None = None
        self.budget_spent = False
        self.stopped_at: float | None = None
        self.gave_up_on_final_eval = False
        self.num_shards = num_shards
        self.train_size = train_size
        self.started = time.monotonic() if now is None else now
        self.members: dict[str, Member] = {}
        self.instances: dict[str, str] = {}  # HELLO.instance -> the member it registered
        self.quarantined_instances: set[str] = set()  # processes a shard quarantined: never admitted again
        self.shards: dict[int, Member] = {}
        self.allocation: dict[str, int] = {}
        self.previous_allocation: dict[str, int] = {}  # the one before: a worker may still step with it
        self.membership = 0
        self.assignment_id = 0
        self.decisions: list[Decision] = []
        self.departed_samples = 0
        self.unchecked_shards: set[int] = set()  # after a resume: shard slots yet to report their samples
        self.most_shard_samples = 0
        self.loss = math.nan
        self.eval: EvalReport | None = None
        self.stop_latched = False  # see `stopping`
        self.trained_at_beats: dict[int, int] | None = None  # each shard's heartbeats when the epochs were reached
        self.eval_time = 0.0
        self.final_eval = False
        self._next_id = {"worker": 0, "evaluator": 0}
        self.lost_samples = 0  # samples shards lost in restarts, counted back into the job
        self.lost_versions = 0
        self.shard_marks: dict[int, ShardMark] = {}  # each slot's newest reported version and samples
        self.losses: list[LostWork] = []  # restarts the server has yet to log
        self.resumed_speeds: dict[str, SavedSpeed] = {}  # speed models of a saved job, by HELLO instance
        self.rounds_reached = False  # every shard has had a round protocol's rounds (sticky: see _rounds_done)
        self.divergence = DivergenceWatch()
        self.rollbacks: list[Rollback] = []
        self.rollback_number = 0  # the last rollback ordered (a shard may know of a later one than a fresh scheduler)
        self.rollback_done = 0  # the last rollback every shard has applied: what workers are told to act on
        self.eval_rollbacks = 0  # the last rollback done when the evaluation kept was taken
        self.stall = StallWatch()
        self.failed = ""  # why the job gave up; a failed job stops as a finished one does

    # -- membership -------------------------------------------------------------

    def hello(self, hello: Hello, now: float, connection: bytes = b"",
              admit: Callable[[], None] = lambda: None) -> Welcome:
        """Admit a process; shards take a slot, workers wait until every shard is there.

        The member is bound to `connection` (the ROUTER routing id it registered from):
        every later message in its name must come from there. The same process (same
        `instance`) may say HELLO again from a new connection and is rebound to it.
        `admit` is called just before a new member is made, and may refuse it by raising.
        """
        if hello.role not in ("worker", "evaluator", "ps"):
            raise ProtocolError("bad_field", f"HELLO.role {hello.role!r} is not worker, evaluator or ps")
        if len(hello.instance) > MAX_INSTANCE_CHARS:
            raise ProtocolError("bad_field", f"HELLO.instance is longer than {MAX_INSTANCE_CHARS} characters")
        if hello.max_batch < 0:
            raise ProtocolError("bad_field", f"HELLO.max_batch must be >= 0 (0: no limit), got {hello.max_batch}")
        if hello.instance in self.quarantined_instances:
            raise ProtocolError("quarantined", "this process was quarantined by a shard (its pushes kept exceeding "
                                "the gradient bound) and may not join again")
        again = self.members.get(self.instances.get(hello.instance, "")) if hello.instance else None
        if again is not None and not again.left and again.role == hello.role:
            again.last_seen = now
            again.connection = connection
            return self._welcome(again)
        if (self.stopping and hello.role == "worker") or (self.finished and hello.role == "evaluator"):
            raise ProtocolError("job_over", "the job has reached its target and is stopping")
        if hello.role == "ps":
            index = self._shard_slot(hello.shard_index)
            member_id = f"ps{index}"
        else:
            if len(self.shards) < self.num_shards:
                raise ProtocolError("not_ready", f"{len(self.shards)} of {self.num_shards} shards registered")
            present = sum(1 for m in self.members.values() if m.role in ("worker", "evaluator") and not m.left)
            if present >= self.job.max_workers:
                raise ProtocolError("full", f"the job admits at most {self.job.max_workers} workers and evaluators "
                                            "(--max-workers)")
            prefix = "w" if hello.role == "worker" else "eval"
            member_id = f"{prefix}{self._next_id[hello.role]}"
            index = -1
        admit()
        if hello.role != "ps":
            self._next_id[hello.role] += 1
        member = Member(member_id, hello.role, hello.name or member_id, hello.host, hello.metrics_url, now, now,
                        endpoint=hello.endpoint, shard_index=index, connection=connection, instance=hello.instance,
                        max_batch=hello.max_batch)
        self.members[member_id] = member
        if hello.instance:
            self.instances[hello.instance] = member_id
        if hello.role == "ps":
            self.shards[index] = member
        return self._welcome(member)

    def _welcome(self, member: Member) -> Welcome:
        return Welcome(id=member.id, config=to_dict(self.job), shards=self.shard_endpoints(),
                       shard_index=member.shard_index)

    def _shard_slot(self, wanted: int) -> int:
        if wanted >= self.num_shards:
            raise ProtocolError("bad_field", f"shard index {wanted} but the job has {self.num_shards} shards")
        if wanted >= 0:
            holder = self.shards.get(wanted)
            if holder is not None and not holder.left:
                raise ProtocolError("slot_taken", f"shard slot {wanted} is held by a live shard; a restarted shard "
                                                  "takes it once that one is declared dead")
            return wanted  # a restarted shard takes its slot back
        free = [i for i in range(self.num_shards) if i not in self.shards]
        if not free:
            raise ProtocolError("no_slot", f"all {self.num_shards} shard slots are taken")
        return free[0]

    def shard_endpoints(self) -> list[str]:
        return [self.shards[i].endpoint for i in sorted(self.shards)]

    def member(self, member_id: str, connection: bytes = b"") -> Member:
        """The live member `member_id`, if this message came over the connection it registered from."""
        member = self.members.get(member_id)
        if member is None or member.left:
            raise ProtocolError("unknown_sender", f"{member_id!r} is not registered; send HELLO")
        if member.connection != connection:
            raise ProtocolError("bad_sender", f"{member_id!r} registered from another connection; a message in its "
                                              "name from this one is refused")
        return member

    def bye(self, member_id: str, now: float, connection: bytes = b"") -> bool:
        """Drop a member that leaves; False if it had already gone (a BYE sent again because its ack was slow)."""
        known = self.members.get(member_id)
        if known is not None and known.left:
            return False
        self._drop(self.member(member_id, connection), now, "left")
        return True

    def excuse(self, seconds: float) -> None:
        """The scheduler itself heard nothing for `seconds` (its process stalled: a slow disk under the
        progress file's fsync, a paused VM, a starved CPU): no member is blamed for that silence."""
        for m in self.members.values():
            m.last_seen += seconds

    def expire(self, now: float) -> list[str]:
        """Drop members whose heartbeats stopped, and workers holding a batch whose steps stopped
        (progress_watch.py); returns their ids."""
        job = self.job
        dead = [m for m in self.members.values()
                if not m.left and now - m.last_seen > silence_allowed(m, job.liveness_timeout_s, job.join_timeout_s)]
        for m in dead:
            self._drop(m, now, "heartbeat timeout")
        stuck = [m for m in self.members.values()
                 if m.role == "worker" and not m.left and self.training_started and self.batch_of(m.id) > 0
                 and stalled(m.progress_since, now, m.last.step_s, job.liveness_timeout_s, job.join_timeout_s)]
        for m in stuck:
            log.warning("%s (%s) holds batch %d but finished no step for %.0f s (its steps take %.3f s): dropped "
                        "from rounds and from the end of the job; it may register again", m.id, m.name,
                        self.batch_of(m.id), now - m.progress_since, m.last.step_s)
            self._drop(m, now, "no progress")
        return [m.id for m in dead + stuck]

    def _drop(self, member: Member, now: float, why: str) -> None:
        member.left = True
        if member.role == "worker":
            self.divergence.forget(member.id)
        if member.role == "worker" and member.admitted_in:
            self.membership += 1
            self.departed_samples += member.samples
            self.departed_bytes += member.last.bytes
            self.departed_staleness = staleness.add(self.departed_staleness, member.last.staleness)
        if member.role == "ps" and self.shards.get(member.shard_index) is member:
            del self.shards[member.shard_index]
        if member.id in self.allocation:
            self._reallocate(now, why, member.id, force=True)
        self._forget_departed()

    def _quarantine(self, workers: list[str], shard: str, now: float) -> None:
        """Drop the live workers a shard quarantined (their pushes kept exceeding the gradient bound); their
        process may not register again (its HELLO.instance is refused)."""
        for wid in workers:
            member = self.members.get(wid)
            if member is None or member.left or member.role != "worker":
                continue
            log.warning("%s quarantined by %s: its pushes kept exceeding the gradient bound; dropped", wid, shard)
            if member.instance:
                self.quarantined_instances.add(member.instance)
            self._drop(member, now, "quarantined")

    def _forget_departed(self) -> None:
        """Keep the member table bounded: the oldest members that left go (their counts are already summed)."""
        gone = [m for m in self.members.values() if m.left]
        for m in gone[:max(0, len(gone) - DEPARTED_KEPT)]:
            del self.members[m.id]
            if self.instances.get(m.instance) == m.id:
                del self.instances[m.instance]

    @property
    def live_workers(self) -> list[str]:
        """Workers that have reported their measured speed: one that registered and fell silent, or that only
        heartbeats while it loads, is never counted in n (an ssgd round would wait for it)."""
        return sorted(m.id for m in self.members.values() if m.role == "worker" and not m.left and m.admitted_in)

    # -- heartbeats and progress ------------------------------------------------

    def heartbeat(self, member_id: str, hb: Heartbeat, now: float, connection: bytes = b"") -> Assignment:
        """Record a heartbeat and answer with the member's current assignment."""
        member = self.member(member_id, connection)
        prev = member.last
        self.check_budget(now)
        if member.role == "worker":
            # A local round's steps are reported at its end, after heartbeats that repeated the old counters:
            # they fit in the time since the counters last grew, not since the last heartbeat.
            check_worker_heartbeat(member.last, hb, now - (member.progress_at or member.joined), self.job.max_batch,
                                   self.num_shards)
            check_rollbacks(hb, self.job.max_rollbacks)
            if hb.steps != member.last.steps or hb.skipped != member.last.skipped or not member.progress_at:
                member.progress_at = now
            if not member.admitted_in and hb.standalone_sps > 0:
                # Its first report (a worker heartbeats from its WELCOME on, while it loads and measures itself,
                # and is counted in n only once ready): from now on it is live, and every shard must learn it.
                self.membership += 1
                member.admitted_in = self.membership
            self._worker_heartbeat(member, hb, now)
            # A worker's report counts once it has dropped the model of before the last rollback, which it is
            # told to do only once every shard has restored its checkpoint (assignment_for).
            self.divergence.worker(member.id, member.last, hb,
                                   hb.rollbacks >= self.rollback_number and self._rollbacks_settled)
        if member.role == "ps":
            check_shard_heartbeat(hb, self.job.max_rollbacks)
        member.last_seen = now
        member.heartbeats += 1
        member.last = hb
        if member.role == "ps" and 0 < hb.train_size <= MAX_TRAIN_SIZE:
            self.train_size = hb.train_size
        if member.role == "ps":
            self._shard_progress(member.shard_index, hb)
            self._check_resumed(member.shard_index, hb.samples)
            self._quarantine(hb.quarantined, member.id, now)
            self.rollback_number = max(self.rollback_number, hb.rollbacks)
            self._shard_rolled_back(member.shard_index, prev, hb)
            self.divergence.shard(member.shard_index, hb, self._rollbacks_settled)
            waiting = [m.id for m in self._ready_workers(known_to_shards=False).values() if m.id not in self.allocation]
            if waiting and self._known_to_shards(self.members[waiting[0]]):
                self._reallocate(now, "joined", waiting[0], force=True)
        self._on_divergence(now)
        answer = self.assignment_for(member)
        if member.role == "ps":
            member.told_batches = answer.batches
        return answer

    def _shard_rolled_back(self, index: int, prev: Heartbeat, hb: Heartbeat) -> None:
        """Record the version a shard restored: its first report after the rollback, sent before it took a push."""
        last = self.rollbacks[-1] if self.rollbacks else None
        if last is None or last.done or not prev.rollbacks < last.number <= hb.rollbacks:
            return
        last.versions[str(index)] = hb.version
        last.done = self._rollbacks_settled

    @property
    def _rollbacks_settled(self) -> bool:
        """Has every shard applied the last rollback? Until then reports describe the model thrown away."""
        settled = len(self.shards) == self.num_shards and all(
            shard.last.rollbacks >= self.rollback_number for shard in self.shards.values())
        if settled:
            self.rollback_done = self.rollback_number
        return settled

    def _on_divergence(self, now: float) -> None:
        """Roll the job back if it diverged (every shard to its last good checkpoint, half the step size), or
        give up once it has rolled back --max-rollbacks times."""
        cause = self.divergence.cause
        if not cause or self.failed:
            return
        if self.rollback_number >= self.job.max_rollbacks:
            self.failed = (f"diverged at epoch {self.epoch:.2f} ({cause}) after {self.rollback_number} rollback(s) "
                           f"(--max-rollbacks {self.job.max_rollbacks}); lower --lr or check the task")
            return
        self.rollback_number += 1
        self.rollbacks.append(Rollback(self.rollback_number, now - self.started, self.epoch, cause,
                                       {str(i): m.last.good_version for i, m in sorted(self.shards.items())},
                                       lr_factor(self.rollback_number)))
        self.divergence.rolled_back()

    @property
    def lr_factor(self) -> float:
        """The job's step-size factor after its rollbacks."""
        return lr_factor(self.rollback_number)

    def _shard_progress(self, index: int, hb: Heartbeat) -> None:
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
            log.warning("the saved progress counts %d samples but the shards hold at most %d: counting %d fewer",
                        self.samples, allowed, excess)
            self.departed_samples -= excess

    def _known_to_shards(self, worker: Member) -> bool:
        """Has every shard applied a live worker set that holds `worker`?"""
        return all(shard.last.membership >= worker.admitted_in for shard in self.shards.values())

    def _worker_heartbeat(self, member: Member, hb: Heartbeat, now: float) -> None:
        bad_counts = staleness.check(hb.staleness)
        if bad_counts:
            raise ProtocolError("bad_field", f"HEARTBEAT.staleness: {bad_counts}")
        new_steps = hb.steps - member.steps
        member.steps, member.samples = hb.steps, hb.samples
        if member.speed is None and hb.standalone_sps > 0:
            member.standalone_sps = hb.standalone_sps
            member.speed = SpeedModel(self.job.speed_window, self.job.speed_forgetting, hb.standalone_sps)
            for batch, seconds in self._resumed_speed(member):
                member.speed.observe(batch, seconds)
            self._reallocate(now, "joined", member.id, force=True)
        if new_steps > 0 and hb.batch > 0 and hb.step_s > 0 and member.speed is not None:
            member.speed.observe(hb.batch, own_step_seconds(hb))
            member.step_s_total += hb.step_s * new_steps
            member.data_s_total += hb.data_s * new_steps
            member.observed_steps += new_steps
            member.compute_s_total += hb.compute_s * new_steps
            member.observed_samples += hb.batch * new_steps
            if math.isfinite(hb.loss):
                self.loss = hb.loss if math.isnan(self.loss) else (
                    LOSS_SMOOTHING * self.loss + (1 - LOSS_SMOOTHING) * hb.loss)
            self._reallocate(now, "speed update", member.id)
            if self.spec.adaptive_local_steps:
                self._adapt_local_steps(now, hb)

    def eval_report(self, member_id: str, report: EvalReport, now: float, connection: bytes = b"") -> None:
        """Keep the newest evaluation. Only an evaluator reports one, of a version the shards can have
        reached, within common/eval_bounds.py; anything else is refused and changes nothing."""
        member = self.member(member_id, connection)
        if member.role != "evaluator":
            raise ProtocolError("bad_sender", f"{member_id} is a {member.role}; only an evaluator reports evaluations")
        problem = eval_problem(report)
        if problem:
            raise ProtocolError("bad_field", problem)
        check_eval_version(report, self.newest_possible_version)
        member.last_seen = now
        # After a rollback the model's version is lower than the evaluation's of the diverged model: the first
        # evaluation of a restored version (once every shard restored its checkpoint) replaces it.
        held = report.version <= max((m.last.version for m in self.shards.values()), default=0)
        restored = held and self.eval_rollbacks < self.rollback_done
        if self.eval is None or report.version >= self.eval.version or report.final or restored:
            self.eval = report
            self.eval_time = now - self.started
            if held:
                self.eval_rollbacks = self.rollback_done
        if report.final and self.stopping:
            self.final_eval = True

    @property
    def newest_possible_version(self) -> int:
        """No shard can be past this version: every update takes a push of at least --min-batch samples,
        and every worker may have one push on its way that its heartbeat has not counted yet."""
        reported = max((m.last.version for m in self.shards.values()), default=0)
        pushes = math.ceil(self.samples / self.job.min_batch) + len(self.live_workers) + 1
        return max(reported, pushes)

    @property
    def samples(self) -> int:
        return self.departed_samples + sum(m.samples for m in self.members.values() if m.role == "worker" and not m.left)

    @property
    def kept_samples(self) -> int:
        """The samples whose updates the model still holds: those trained, less those shards lost."""
        return max(0, self.samples - self.lost_samples)

    @property
    def epoch(self) -> float:
        """The job's progress in passes over the training set, counted from the samples the model holds."""
        return self.kept_samples / self.train_size if self.train_size else 0.0

    @property
    def stopping(self) -> bool:
        """The job's end has begun: its target reached, its budget spent, or it failed. A latch: once workers
        have been told to stop they leave, so work lost afterwards (a rollback, a shard back from an older
        checkpoint) cannot be trained again, and a job waiting for it would wait for ever. For the same reason
        the job's epochs do not count as reached while its model is in doubt: the samples trained meanwhile may be
        thrown away by a rollback, which would otherwise end the job at the restored model."""
        if not self.stop_latched:
            self.stop_latched = self._trained_and_confirmed or self.budget_spent or bool(self.failed)
        return self.stop_latched

    @property
    def _trained_and_confirmed(self) -> bool:
        """The job's epochs (or rounds) are reached, and every shard has since reported its model healthy.

        Workers report the samples of pushes already applied, so a shard's heartbeat
        sent after the report that reached the epochs judges the model that holds
        them; the second heartbeat received after it surely was sent after it.
        """
        if self._model_in_doubt or not (self.epoch >= self.job.epochs or self._rounds_done):
            self.trained_at_beats = None
            return False
        if self.trained_at_beats is None:
            self.trained_at_beats = {i: s.heartbeats for i, s in self.shards.items()}
        return all(s.heartbeats >= self.trained_at_beats.get(i, 0) + 2 for i, s in self.shards.items())

    @property
    def _model_in_doubt(self) -> bool:
        """The job diverged and is not yet rolled back: a cause is known, a rollback is ordered that not every
        shard has applied, or a shard reports its parameters sick."""
        pending = self.rollback_number > self.rollback_done and not self._rollbacks_settled
        return bool(self.divergence.cause) or pending or any(s.last.model_problem for s in self.shards.values())

    @property
    def _rounds_done(self) -> bool:
        """Workers of a round protocol (ssgd) stop by themselves once every shard has had the job's rounds;
        so does the job.

        Counting samples alone could leave the job one step short for ever if a
        worker's step was lost in a retry, with every worker already gone. Once
        reached it stays reached: the shards leave at the end, taking the versions
        that showed it with them, and a job whose samples fell short would then
        wait for ever for workers that had already stopped.
        """
        if self.rounds_reached:
            return True
        if not self.spec.ends_by_rounds or len(self.shards) < self.num_shards or not self.train_size:
            return False
        rounds = math.ceil(self.job.epochs * self.train_size / self.job.global_batch)
        self.rounds_reached = all(shard.last.version >= rounds for shard in self.shards.values())
        return self.rounds_reached

    def check_budget(self, now: float) -> None:
        """Stop the job once `time_budget_s` has passed since the first batches were handed out."""
        if self.job.time_budget_s > 0 and self.training_started_at is not None and not self.budget_spent:
            self.budget_spent = now - self.training_started_at >= self.job.time_budget_s

    def tick(self, now: float) -> bool:
        """The clock's part of the job's end: the time budget, and how long a final evaluation is awaited.

        Returns True once, when the job gives up waiting for an evaluator to join.
        """
        self.check_budget(now)
        self._check_stall(now)
        if self.stopping and self.stopped_at is None:
            self.stopped_at = now
        if (self.job.await_final_eval and not self.gave_up_on_final_eval and not self.final_eval
                and self.stopped_at is not None and not self._evaluators()
                and now - self.stopped_at > self.job.join_timeout_s):
            self.gave_up_on_final_eval = True
            return True
        return False

    def _check_stall(self, now: float) -> None:
        """Fail a job that trains nothing for longer than its workers' steps allow (stall.py)."""
        workers = [self.members[w] for w in self.live_workers]
        training = self.training_started and bool(workers) and not self.stopping
        still = self.stall.observe(self.samples, now, training)
        limit = stall_limit_s([m.last.step_s for m in workers], self.job.join_timeout_s)
        if training and still > limit:
            skipped = sum(m.last.skipped for m in workers)
            self.failed = (f"no sample trained for {still:.0f} s (limit {limit:.0f} s: the join timeout, or 50 of the "
                           f"slowest worker's steps) while {len(workers)} worker(s) were live"
                           + (f"; they skipped {skipped} steps whose loss was not finite" if skipped else ""))

    def _evaluators(self) -> list[Member]:
        return [m for m in self.members.values() if m.role == "evaluator" and not m.left]

    @property
    def finished(self) -> bool:
        """Target reached, every worker gone, and the final model evaluated (if anyone evaluates).

        With `await_final_eval` a job stays unfinished while no evaluator is
        connected, for up to `join_timeout_s` after it stopped: a short job
        can reach its target before its evaluator has loaded the test set.
        """
        if not self.stopping or self.live_workers:
            return False
        if self.failed:
            return True  # a model that diverged or never trained is not worth a final evaluation
        if self.final_eval or self._evaluators():
            return self.final_eval
        return not self.job.await_final_eval or self.gave_up_on_final_eval

    def _adapt_local_steps(self, now: float, hb: Heartbeat) -> None:
        """AdaComm's H from the smoothed loss, bounded by the measured sync/compute ratio."""
        if math.isnan(self.first_loss) and math.isfinite(self.loss):
            self.first_loss = self.loss
        workers = [self.members[w].last for w in self.live_workers]
        sync_s = max((w.sync_s for w in workers), default=0.0)
        compute_s = min((w.compute_s for w in workers if w.compute_s > 0), default=0.0)
        decision = adacomm_steps(self.job.local_steps, self.local_steps, self.first_loss, self.loss, sync_s, compute_s)
        if decision.steps != self.local_steps:
            self.local_steps, self.local_steps_reason = decision.steps, decision.reason
            self.assignment_id += 1
            self.decisions.append(Decision(now - self.started, "local steps", f"H={decision.steps}: {decision.reason}",
                                           dict(self.allocation), {}))
            del self.decisions[:-DECISIONS_KEPT]

    @property
    def bytes(self) -> int:
        """Tensor bytes moved between workers and shards (both directions), from workers' counters."""
        return self.departed_bytes + sum(
            m.last.bytes for m in self.members.values() if m.role == "worker" and not m.left)

    @property
    def staleness_counts(self) -> list[int]:
        """Updates by staleness over the whole job, departed workers included."""
        total = self.departed_staleness
        for m in self.members.values():
            if m.role == "worker" and not m.left:
                total = staleness.add(total, m.last.staleness)
        return total

    # -- allocation ---------------------------------------------------------------

    def _reallocate(self, now: float, reason: str, subject: str, force: bool = False) -> None:
        """Re-solve the batch split; `reason` is a bounded label, `subject` the worker behind it."""
        ready = self._ready_workers(known_to_shards=True)
        if not ready or (not self.allocation and len(ready) < self.job.min_workers and not self.training_started):
            self.previous_allocation, self.allocation = self.allocation, {}
            return
        if not self.training_started:
            self.training_started, self.training_started_at = True, now
        models = {wid: m.speed.fit() for wid, m in ready.items()}
        caps = {wid: m.max_batch for wid, m in ready.items() if m.max_batch > 0}
        job = self.job
        if job.batch_policy == "fixed" or any(model is None for model in models.values()):
            proposed = fixed_allocation(sorted(ready), job.global_batch, job.min_batch, job.max_batch, caps)
        else:
            proposed = allocation_for(self.spec)(models, job.global_batch, job.min_batch, job.max_batch, caps)
        if not force and not needs_reassign(self.allocation, proposed, self.job.reassign_threshold):
            return
        if proposed == self.allocation:
            return
        self.previous_allocation, self.allocation = self.allocation, proposed
        for wid, b in proposed.items():
            if b > 0 and not self.previous_allocation.get(wid, 0):
                self.members[wid].batch_given_at = now
        self.assignment_id += 1
        predicted = {wid: models[wid].step_seconds(b) for wid, b in proposed.items()
                     if models[wid] is not None and b > 0}
        notes = [reason, bounds_note(proposed, job.global_batch)]
        if 0 in proposed.values():
            notes.append("slowest left out: the round is faster without them (batch 0)")
        self.decisions.append(Decision(now - self.started, "; ".join(n for n in notes if n), subject,
                                       dict(proposed), predicted))
        del self.decisions[:-DECISIONS_KEPT]

    @property
    def holding_batch(self) -> int:
        """Workers the allocation gives a batch (DBS-SGD's n): not those left out with batch 0."""
        return sum(1 for b in self.allocation.values() if b > 0)

    def _ready_workers(self, known_to_shards: bool) -> dict[str, Member]:
        """Workers that can take a batch: measured, and (for a first batch) known to every shard."""
        return {m.id: m for m in self.members.values()
                if m.role == "worker" and not m.left and m.speed is not None
                and (not known_to_shards or m.id in self.allocation or self._known_to_shards(m))}

    def assignment_for(self, member: Member) -> Assignment:
        """What `member` should do now."""
        base = dict(assignment_id=self.assignment_id)
        if member.role == "ps":
            return Assignment(**base, live_workers=self.live_workers, allocated=self.holding_batch,
                              idle_workers=sorted(w for w, b in self.allocation.items() if b == 0),
                              membership=self.membership, stop=self.finished, batches=self._push_bounds(),
                              progress=min(1.0, self.epoch / self.job.epochs) if self.job.epochs else 0.0,
                              rollbacks=self.rollback_number, lr_factor=self.lr_factor,
                              hold_checkpoints=self.divergence.suspect)
        if member.role == "evaluator":
            return Assignment(**base, stop=self.stopping and not self.live_workers)
        batch = self.batch_of(member.id)
        scale = dbs_weight(batch, self.job.global_batch, self.holding_batch, self.job.dbs_weight)
        return Assignment(
            **base, batch=batch, lr_scale=scale * self.lr_factor,
            stop=self.stopping, local_steps=self.local_steps, rollbacks=self.rollback_done,
        )

    def _push_bounds(self) -> dict[str, int]:
        """Each live worker's largest batch now, the previous allocation's or the current one's: a shard refuses a
        PUSH of more samples (times the local steps a delta covers) than its sender's."""
        live = set(self.live_workers)
        return {w: max(self.previous_allocation.get(w, 0), self.allocation.get(w, 0))
                for w in (self.previous_allocation.keys() | self.allocation.keys()) & live}

    def batch_of(self, worker: str) -> int:
        """The batch `worker` holds: its allocation, or less while a live shard has not yet been told that it may
        push that much (a worker is given a larger batch only once the shards bound its pushes by it). A shard
        never answered yet is not waited on: it takes no push before it learns the live workers, and their bounds,
        in that same answer. The one owner of a worker's batch: its assignment, STATUS and the metrics read it."""
        return min([self.allocation.get(worker, 0), *(m.told_batches.get(worker, 0) for m in self.shards.values()
                                                      if not m.left and m.told_batches is not None)])

    # -- reporting ------------------------------------------------------------------

    def status(self, now: float) -> JobStatus:
        """The job as `dynabatch run` and operators see it (the server adds its decision latency)."""
        ev = self.eval
        return JobStatus(
            t=now - self.started,
            job=self.job.job,
            protocol=self.job.protocol,
            batch_policy=self.job.batch_policy,
            epoch=self.epoch,
            target_epochs=self.job.epochs,
            samples=self.samples,
            lost_samples=self.lost_samples,
            lost_versions=self.lost_versions,
            bytes=self.bytes,
            staleness=self.staleness_counts,
            training_t=None if self.training_started_at is None else now - self.training_started_at,
            budget_spent=self.budget_spent,
            local_steps=self.local_steps,
            local_steps_reason=self.local_steps_reason,
            loss=_finite_or_none(self.loss),
            test_acc=_finite_or_none(ev.test_acc) if ev else None,
            test_loss=ev.test_loss if ev else None,
            metrics=dict(ev.metrics) if ev else {},
            train_size=self.train_size,
            eval_version=ev.version if ev else None,
            eval_t=self.eval_time if ev else None,
            stopping=self.stopping,
            finished=self.finished,
            final_eval=self.final_eval,
            assignment_id=self.assignment_id,
            workers={m.id: m.public(self.batch_of(m.id)) for m in self.members.values()
                     if m.role == "worker" and not m.left},
            departed=sorted(m.id for m in self.members.values() if m.role == "worker" and m.left),
            shards={str(i): ShardStatus(m.endpoint, m.last.version, m.last.updates, m.metrics_url, m.last.discarded,
                                        m.last.model_problem, m.last.good_version)
                    for i, m in sorted(self.shards.items())},
            decisions=self.decisions[-10:],
            rollbacks=[replace(r, versions=dict(r.versions)) for r in self.rollbacks],
            lr_factor=self.lr_factor,
            failed=self.failed,
        )

    # -- restart ------------------------------------------------------------------------

    def saved(self, now: float, wall: ClockReading) -> SavedProgress:
        """What a restarted scheduler needs to go on with this job (saved_progress.py); `wall` is read_clock()."""
        speeds = {m.instance: SavedSpeed(m.standalone_sps, m.speed.window())
                  for m in self.members.values() if m.instance and not m.left and m.speed is not None}
        return SavedProgress(
            config=to_dict(self.job), saved_at=wall.wall, saved_boot_id=wall.boot_id, saved_boot_s=wall.boot_s,
            t=now - self.started, samples=self.samples, lost_samples=self.lost_samples,
            lost_versions=self.lost_versions, train_size=self.train_size,
            training_s=None if self.training_started_at is None else now - self.training_started_at,
            assignment_id=self.assignment_id, next_id=dict(self._next_id), local_steps=self.local_steps,
            local_steps_reason=self.local_steps_reason, loss=_finite_or_none(self.loss),
            first_loss=_finite_or_none(self.first_loss), eval=self.eval, eval_time=self.eval_time,
            final_eval=self.final_eval, budget_spent=self.budget_spent, shard_marks=dict(self.shard_marks),
            speeds=dict(list({**self.resumed_speeds, **speeds}.items())[-self.job.max_workers:]),
            rollbacks=list(self.rollbacks),
        )

    def resume(self, saved: SavedProgress, now: float, wall: ClockReading) -> None:
        """Go on from `saved`: its samples count as trained by workers that left, every process registers anew.

        The job's clock goes on through the outage (from the save to `wall`, read_clock(): never negative, and
        bounded where a wall clock that may have jumped is all there is; outage_clock.py): time to accuracy and
        the time budget are what the user waited, restarts included. The saved samples are checked against the
        shards' own counts once every shard has reported (`_check_resumed`).
        """
        down = 0.0 if saved.saved_at is None else outage_s(
            ClockReading(saved.saved_at, saved.saved_boot_id, saved.saved_boot_s), wall)
        self.unchecked_shards = set(range(self.num_shards))
        now -= down
        self.started = now - saved.t
        self.departed_samples = saved.samples
        self.lost_samples, self.lost_versions = saved.lost_samples, saved.lost_versions
        self.train_size = saved.train_size
        if saved.training_s is not None:
            self.training_started, self.training_started_at = True, now - saved.training_s
        self.assignment_id = saved.assignment_id
        self._next_id.update(saved.next_id)
        self.local_steps, self.local_steps_reason = saved.local_steps or self.local_steps, saved.local_steps_reason
        self.loss = math.nan if saved.loss is None else saved.loss
        self.first_loss = math.nan if saved.first_loss is None else saved.first_loss
        self.eval, self.eval_time, self.final_eval = saved.eval, saved.eval_time, saved.final_eval
        self.budget_spent = saved.budget_spent
        self.shard_marks = dict(saved.shard_marks)
        self.resumed_speeds = dict(saved.speeds)
        self.rollbacks = list(saved.rollbacks)
        self.rollback_number = self.rollback_done = self.eval_rollbacks = len(self.rollbacks)

    def _resumed_speed(self, member: Member) -> list[tuple[int, float]]:
        """The steps a saved job's speed model of this process had seen (none for a process new to the job)."""
        saved = self.resumed_speeds.pop(member.instance, None)
        return saved.observations if saved is not None else []
