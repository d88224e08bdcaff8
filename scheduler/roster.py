"""Who is in the job: registration, the connection each member is bound to, liveness, and departures.

Processes say HELLO and get an id (workers `w<n>`, evaluators `eval<n>`, shards
the slot `ps<i>` they hold); every later message in a member's name must come
over the connection it registered from. A member that falls silent for longer
than its role and its own measured steps allow is found here (`silent`); the job
(job_state.py) decides what a departure changes elsewhere.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dynabatch.common.config import JobConfig
from dynabatch.common.slowdown import MAX_SLOWDOWN_CHARS, Slowdown
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.member_ids import member_id
from dynabatch.common.wire.member_name import name_problem
from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat, WorkerHeartbeat, WorkerStatus

DEPARTED_KEPT = 1000  # members that left, kept for STATUS; older ones are forgotten (their counts stay)
MAX_INSTANCE_CHARS = 64
LIVENESS_STEPS = 3  # steps of its own measured length a worker may be silent before it is dropped
LIVENESS_GAPS = 3  # times its heartbeats' longest recent lateness a member may be silent before it is dropped
GAPS_KEPT = 32  # the recent gaps between a member's heartbeats that its allowed silence follows


def finite_or_none(x: float) -> float | None:
    """A figure for STATUS or the saved progress: JSON has no NaN or infinity."""
    return x if math.isfinite(x) else None


@dataclass
class Member:
    """One registered process and what its heartbeats told us (its batch is the allocator's: allocator.py)."""

    id: str
    role: Role
    name: str
    host: str
    metrics_url: str
    joined: float
    last_seen: float
    endpoint: str = ""
    progress_at: float = 0.0  # when its counters last grew: the steps a report adds were taken since then
    batch_given_at: float = 0.0  # when it was last given a batch after holding none (progress is judged from then)
    shard_index: int = -1
    number: int = 0  # among its role's members, as its id counts it (member_ids.py)
    standalone_sps: float = 0.0
    standalone_fixed_s: float = 0.0  # its probe's fixed seconds per step, as it reported them
    steps: int = 0
    samples: int = 0
    last: WorkerHeartbeat = field(default_factory=WorkerHeartbeat)  # a worker's or evaluator's last report
    shard_last: ShardHeartbeat = field(default_factory=ShardHeartbeat)  # a shard's last report
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
    slowdown: str = ""  # the worker's emulated slowdown (HELLO), as Slowdown.label writes it; "": none reported
    eval_s: float = 0.0  # an evaluator's evaluation time as its reports' arrivals measure it (progress_watch.py)
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))  # between its last reports

    def heard(self, now: float) -> None:
        """A report of its arrived at `now`: it is alive, and the gap since its last report is kept (not the
        wait for its first, which is loading, or a shard's restore: the join timeout's)."""
        if self.heartbeats:
            self.gaps.append(max(0.0, now - self.last_seen))
        self.last_seen = now

    @property
    def progress_since(self) -> float:
        """When its progress is judged from: its last new step, or the batch it was given after holding none."""
        return max(self.progress_at, self.batch_given_at)

    def count_steps(self, hb: WorkerHeartbeat, new_steps: int) -> None:
        """Add `new_steps` steps of the length `hb` reports to the member's totals (STATUS shows their means)."""
        self.step_s_total += hb.times.step_s * new_steps
        self.data_s_total += hb.times.data_s * new_steps
        self.observed_steps += new_steps
        self.compute_s_total += hb.times.compute_s * new_steps
        self.observed_samples += hb.batch * new_steps

    def samples_per_s(self, idle: str = "") -> float:
        """Its last step's samples per second; 0 while it is idle for the reason `idle` (it trains nothing, so its
        last step's speed would read as current)."""
        step_s = self.last.times.step_s
        return self.last.batch / step_s if step_s > 0 and not idle else 0.0

    def public(self, batch: int, idle: str = "") -> WorkerStatus:
        """The member as STATUS shows it, holding `batch` (the allocator owns a worker's batch), idle for the
        reason `idle` ("": not idle)."""
        hb = self.last
        return WorkerStatus(
            role=self.role,
            name=self.name,
            host=self.host,
            metrics_url=self.metrics_url,
            joined=self.joined,
            steps=self.steps,
            samples=self.samples,
            batch=batch,
            times=hb.times,
            samples_per_s=self.samples_per_s(idle),
            standalone_sps=self.standalone_sps,
            standalone_fixed_s=self.standalone_fixed_s,
            loss=finite_or_none(hb.loss),
            step_s_total=self.step_s_total,
            observed_steps=self.observed_steps,
            compute_s_total=self.compute_s_total,
            observed_samples=self.observed_samples,
            version=hb.version,
            endpoint=self.endpoint,
            data_s_total=self.data_s_total,
            max_batch=self.max_batch,
            slowdown=self.slowdown,
            idle=idle,
            discarded=hb.discarded,
        )


def silence_allowed(member: Member, job: JobConfig) -> float:
    """Seconds of silence after which `member` is dropped as dead.

    A worker or evaluator heartbeats from a thread from its WELCOME on, however
    long it loads or computes (worker/pulse.py), so one that registered and never
    heartbeat is a ghost and goes after the liveness timeout. A shard restores its
    checkpoint before its first heartbeat (which reports the version it holds), so
    it has the join timeout for that. Once a worker reports steps, the margin also
    follows its own measured step time: a worker whose process is paused or starved
    for a few of its steps is not dropped. And it follows the member's own recent
    gaps between heartbeats, as a failure detector that learns its peers' spacing
    does: on a machine with more runnable threads than cores a live process's
    heartbeats arrive as late as its threads wait for a core, which no fixed timeout
    fits on every machine. What counts is how late they came, a gap beyond the
    heartbeat interval. Both are capped by the join timeout, so no report can buy
    unlimited silence.
    """
    if member.heartbeats == 0 and member.role == Role.SHARD:
        return max(job.liveness_timeout_s, job.join_timeout_s)
    by_steps = min(LIVENESS_STEPS * member.last.times.step_s, job.join_timeout_s)
    late_s = max(member.gaps, default=0.0) - job.heartbeat_s
    by_gaps = min(LIVENESS_GAPS * late_s, job.join_timeout_s)
    return max(job.liveness_timeout_s, by_steps, by_gaps)


def slowdown_label(text: str) -> str:
    """HELLO.slowdown as STATUS shows it ("" stays ""); ProtocolError unless it is a slowdown schedule."""
    if not text:
        return ""
    if len(text) > MAX_SLOWDOWN_CHARS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"HELLO.slowdown is longer than {MAX_SLOWDOWN_CHARS} characters")
    try:
        return Slowdown.parse(text).label()
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"HELLO.slowdown: {exc}") from None


class Roster:
    """Membership: who is in the job, over which connection, since when, and which membership number it is at."""

    def __init__(self, job: JobConfig, num_shards: int) -> None:
        self.job = job
        self.num_shards = num_shards
        self.members: dict[str, Member] = {}
        self.instances: dict[str, str] = {}  # HELLO.instance -> the member it registered
        self.quarantined_instances: set[str] = set()  # processes a shard quarantined: never admitted again
        self.shards: dict[int, Member] = {}
        self.membership = 0  # grows whenever the live worker set changes; shards report the one they applied
        self.next_id = {Role.WORKER.value: 0, Role.EVALUATOR.value: 0}
        self.hold_since: float | None = None  # when the hold on workers silent all at once began (`held`)
        self.held_ids: list[str] = []

    def check_hello(self, hello: Hello) -> None:
        """Refuse a HELLO whose fields cannot be, or from a process a shard quarantined."""
        if len(hello.instance) > MAX_INSTANCE_CHARS:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"HELLO.instance is longer than {MAX_INSTANCE_CHARS} characters")
        problem = name_problem(hello.name)
        if problem:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"HELLO.name: {problem}")
        slowdown_label(hello.slowdown)
        if hello.max_batch < 0:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"HELLO.max_batch must be >= 0 (0: no limit), got {hello.max_batch}"
            )
        if hello.instance in self.quarantined_instances:
            raise ProtocolError(
                ErrorCode.QUARANTINED,
                "this process was quarantined by a shard (its pushes kept exceeding "
                "the gradient bound or pointing against the other workers') and may not join again",
            )

    def rebind(self, hello: Hello, now: float, connection: bytes) -> Member | None:
        """The live member this process (same `instance`, same role) already is, rebound to `connection`."""
        again = self.members.get(self.instances.get(hello.instance, "")) if hello.instance else None
        if again is None or again.left or again.role != hello.role:
            return None
        again.last_seen = now
        again.connection = connection
        return again

    def register(self, hello: Hello, now: float, connection: bytes, admit: Callable[[], None]) -> Member:
        """A new member: a shard takes a slot, workers and evaluators wait until every shard is there.
        `admit` is called just before it is made, and may refuse it by raising."""
        if hello.role == Role.SHARD:
            index = number = self._shard_slot(hello.shard_index)
        else:
            if len(self.shards) < self.num_shards:
                raise ProtocolError(ErrorCode.NOT_READY, f"{len(self.shards)} of {self.num_shards} shards registered")
            present = sum(1 for m in self.members.values() if m.role != Role.SHARD and not m.left)
            if present >= self.job.max_workers:
                raise ProtocolError(
                    ErrorCode.FULL,
                    f"the job admits at most {self.job.max_workers} workers and evaluators (--max-workers)",
                )
            index, number = -1, self.next_id[hello.role]
        new_id = member_id(hello.role, number)
        admit()
        if hello.role != Role.SHARD:
            self.next_id[hello.role] += 1
        member = Member(
            new_id,
            hello.role,
            hello.name or new_id,
            hello.host,
            hello.metrics_url,
            now,
            now,
            endpoint=hello.endpoint,
            shard_index=index,
            number=number,
            connection=connection,
            instance=hello.instance,
            max_batch=hello.max_batch,
            slowdown=slowdown_label(hello.slowdown),
        )
        self.members[new_id] = member
        if hello.instance:
            self.instances[hello.instance] = new_id
        if hello.role == Role.SHARD:
            self.shards[index] = member
        return member

    def _shard_slot(self, wanted: int) -> int:
        if wanted >= self.num_shards:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"shard index {wanted} but the job has {self.num_shards} shards")
        if wanted >= 0:
            holder = self.shards.get(wanted)
            if holder is not None and not holder.left:
                raise ProtocolError(
                    ErrorCode.SLOT_TAKEN,
                    f"shard slot {wanted} is held by a live shard; a restarted shard "
                    "takes it once that one is declared dead",
                )
            return wanted  # a restarted shard takes its slot back
        free = [i for i in range(self.num_shards) if i not in self.shards]
        if not free:
            raise ProtocolError(ErrorCode.NO_SLOT, f"all {self.num_shards} shard slots are taken")
        return free[0]

    def shard_endpoints(self) -> list[str]:
        return [self.shards[i].endpoint for i in sorted(self.shards)]

    def member(self, member_id: str, connection: bytes = b"") -> Member:
        """The live member `member_id`, if this message came over the connection it registered from."""
        member = self.members.get(member_id)
        if member is None or member.left:
            raise ProtocolError(ErrorCode.UNKNOWN_SENDER, f"{member_id!r} is not registered; send HELLO")
        if member.connection != connection:
            raise ProtocolError(
                ErrorCode.BAD_SENDER,
                f"{member_id!r} registered from another connection; a message in its name from this one is refused",
            )
        return member

    def reporting(self, member_id: str, connection: bytes, shard: bool) -> Member:
        """The member a heartbeat names (from the connection that registered it: `member`), if it reports with
        its role's kind: a shard with SHARD_HEARTBEAT, a worker or evaluator with HEARTBEAT."""
        member = self.member(member_id, connection)
        if (member.role == Role.SHARD) != shard:
            kind = ShardHeartbeat.TYPE if member.role == Role.SHARD else WorkerHeartbeat.TYPE
            raise ProtocolError(ErrorCode.BAD_SENDER, f"{member_id} is a {member.role}; it reports with {kind}")
        return member

    def has_left(self, member_id: str) -> bool:
        """Did `member_id` register and leave (a BYE sent again because its ack was slow)?"""
        known = self.members.get(member_id)
        return known is not None and known.left

    def excuse(self, seconds: float) -> None:
        """The scheduler itself heard nothing for `seconds`: no member is blamed for that silence."""
        for m in self.members.values():
            m.last_seen += seconds

    def _late(self, now: float) -> list[Member]:
        return [m for m in self.members.values() if not m.left and now - m.last_seen > silence_allowed(m, self.job)]

    def held(self, now: float) -> list[Member]:
        """Workers past their allowance that are not dropped, because every live worker fell silent at once.

        Where every live worker of two or more is past its allowance at once, the silence is most likely shared:
        their host starved every process, or the scheduler's link is cut, rather than each of them died. Dropping
        them all would end the job that the stall's end would have resumed, so they are held until the join
        timeout; a worker silent alone, while another still heartbeats, is dropped as before."""
        return self._held(self._late(now), now)

    def _held(self, late: list[Member], now: float) -> list[Member]:
        workers = [m for m in self.members.values() if not m.left and m.role == Role.WORKER and m.heartbeats]
        if len(workers) < 2 or not {m.id for m in workers} <= {m.id for m in late}:
            return []
        return [m for m in late if m.role == Role.WORKER and now - m.last_seen <= self.job.join_timeout_s]

    def silent(self, now: float) -> list[Member]:
        """Live members whose heartbeats stopped for longer than `silence_allowed`, less those `held`."""
        late = self._late(now)
        held = {m.id for m in self._held(late, now)}
        return [m for m in late if m.id not in held]

    def hold_news(self, now: float) -> str | None:
        """The line to log when a hold (`held`) begins or ends, None while neither: an operator should see the
        job wait on its workers' shared silence as it happens, not only from the drop lines at its end."""
        held = self.held(now)
        if held and self.hold_since is None:
            self.hold_since, self.held_ids = now, [m.id for m in held]
            longest = max(now - m.last_seen for m in held)
            return (
                f"every worker fell silent at once ({', '.join(self.held_ids)}; the longest for {longest:.1f} s): "
                f"held, not dropped, for up to {self.job.join_timeout_s:g} s (--join-timeout-s) from its last "
                "heartbeat, as a starved host or a cut link to the scheduler looks like this"
            )
        if held or self.hold_since is None:
            return None
        back = [i for i in self.held_ids if i in self.members and not self.members[i].left]
        line = f"the hold ended after {now - self.hold_since:.1f} s: " + (
            f"heard again from {', '.join(back)}" if back else "no held worker was heard again"
        )
        self.hold_since, self.held_ids = None, []
        return line

    def why_silent(self, member: Member, now: float) -> str:
        """What the log says of a member `silent` found: how long it was silent against what it was allowed."""
        allowed, silence = silence_allowed(member, self.job), now - member.last_seen
        shared = ", held as every worker fell silent at once" if silence > self.job.join_timeout_s > allowed else ""
        return (
            f"{member.id} stopped sending heartbeats: none for {silence:.1f} s, {allowed:.1f} s "
            f"allowed{shared} (after {member.heartbeats})"
        )

    def admit_worker(self, member: Member) -> None:
        """A worker's first report of its speed: from now on it is live, and every shard must learn it."""
        self.membership += 1
        member.admitted_in = self.membership

    def leave(self, member: Member) -> bool:
        """Mark `member` gone; True if it was a live worker, whose departure changes the live worker set."""
        member.left = True
        if member.role == Role.SHARD and self.shards.get(member.shard_index) is member:
            del self.shards[member.shard_index]
        counted = member.role == Role.WORKER and bool(member.admitted_in)
        if counted:
            self.membership += 1
        return counted

    def quarantine(self, member: Member) -> None:
        """Its process may not register again (its HELLO.instance is refused)."""
        if member.instance:
            self.quarantined_instances.add(member.instance)

    def forget_departed(self) -> None:
        """Keep the member table bounded: the oldest members that left go (their counts are already summed)."""
        gone = [m for m in self.members.values() if m.left]
        for m in gone[: max(0, len(gone) - DEPARTED_KEPT)]:
            del self.members[m.id]
            if self.instances.get(m.instance) == m.id:
                del self.instances[m.instance]

    def workers(self) -> list[Member]:
        """Workers that have not left, counted in n or not yet."""
        return [m for m in self.members.values() if m.role == Role.WORKER and not m.left]

    @property
    def live_workers(self) -> list[str]:
        """Workers that have reported their measured speed: one that registered and fell silent, or that only
        heartbeats while it loads, is never counted in n (an ssgd round would wait for it)."""
        return sorted(m.id for m in self.workers() if m.admitted_in)

    def evaluators(self) -> list[Member]:
        return [m for m in self.members.values() if m.role == Role.EVALUATOR and not m.left]

    def known_to_shards(self, worker: Member) -> bool:
        """Has every shard applied a live worker set that holds `worker`?"""
        return all(shard.shard_last.membership >= worker.admitted_in for shard in self.shards.values())

    def newest_shard_version(self) -> int:
        """The newest model version any registered shard reported (0 before any did)."""
        return max((m.shard_last.version for m in self.shards.values()), default=0)

    def model_version(self) -> int:
        """The model's version as a pull sees it: the least advanced registered shard's (0 before any reported)."""
        return min((m.shard_last.version for m in self.shards.values()), default=0)
