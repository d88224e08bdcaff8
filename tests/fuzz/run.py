"""Fuzz a live job: `PYTHONPATH=tests python -m fuzz --messages 100000` (tests/fuzz/__main__.py).

Starts a job (scheduler, shards, workers, evaluator on 127.0.0.1) and, beside it,
the same job untouched as the clean reference. Once the first trains, it learns
what any peer can learn (STATUS, a PULL, a registration of its own) and enlists
a worker of its own in the job: it holds a batch, so every round waits for its
push (or for `--round-timeout-s`), and the job cannot end while the fuzzer has
not said BYE, however slowly the fuzzer runs beside other load. It sends
every attack reported in issue 11 (fuzz/attacks.py: each must be refused
with its code, or bounded), then the scheduler and
every shard messages from fuzz/messages.py: three eighths of them malformed,
five eighths well-formed lies, two of those from its worker: Byzantine gradients
and replays of its own taken PUSHes (fuzz/byzantine.py). Afterwards it checks
that no process exited, that every parameter on every shard is finite, that
every message was refused (an answer other than ERROR is an accepted lie) and
counted in `dynabatch_bad_messages_total`, except the worker's gradients, which
may be taken only bounded (clipped to the gradient bound when far beyond it)
and counted by the shards as its pushes; that the job finished within one point
of test accuracy of the clean one.

The job is bulk-synchronous with fixed batches (under `--aggregation median`, see
JOB), so that its result depends on the data and not on timing: the fuzzed and
the clean job then agree to a fraction of a point unless the fuzz changed what
was trained. The fuzzer's
worker does change it, within the bound, while it is live (the fuzz's length):
the point of margin says that what it could push did not matter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from dynabatch.cluster.launcher import Child, Launcher
from dynabatch.cluster.metric_text import metric_by_label, metric_sum
from dynabatch.common.base_lr import base_lr
from dynabatch.common.config import job_from_dict
from dynabatch.common.tasks.builtin_tasks import builtin_init
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ChunkMeta, Message, ProtocolError, decode, encode
from dynabatch.common.wire.messages import (
    Bye,
    Error,
    Hello,
    JobStatus,
    Params,
    Pull,
    PushAck,
    Role,
    StatusRequest,
    Welcome,
    WorkerHeartbeat,
)
from dynabatch.common.wire.step_times import StepTimes
from dynabatch.ps.peer_limits import backlog_limit
from fuzz.attacks import ATTACKS, UNREAD_PULLS, Attack, AttackResult
from fuzz.byzantine import GRADIENTS, ByzantineMember, judge
from fuzz.messages import BYZANTINE, LIES, SCHEDULER, FuzzMessages, JobView
from harness import PRELOADER_ENV
from processes import rss_bytes

# The configuration docs/operators.md recommends for workers one does not trust, so that the fuzz holds it to account:
# a round protocol under a robust aggregation, beside the gradient bound and direction check (on by default). With
# its worker, the fuzzed job's rounds are medians of 3 where the liar is one, so each value stays between the two
# honest workers'; the clean twin's rounds of 2 are their mean, as under --aggregation mean.
# Rounds do not time out (--round-timeout-s): from its enlistment to its BYE they wait for the fuzzer's worker, which
# heartbeats but pushes only lies, most of them refused, so that the job cannot end under the fuzz. Under the default
# 10 s, a fuzz slowed by load would time the rounds out and the job would run on (and end) without it.
JOB = (
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--protocol",
    "ssgd",
    "--aggregation",
    "median",
    "--batch-policy",
    "fixed",
    "--chunk-bytes",
    "131072",
    "--await-final-eval",
    "--liveness-timeout-s",
    "30",
    "--round-timeout-s",
    "3600",
    "--max-workers",
    "24",
    "--log-level",
    "WARNING",
)
ACCURACY_POINTS = 1.0  # the fuzzed job's accuracy is within this many points of the clean one's
# A connection whose answers stop for this long has its unanswered messages written off. Under two suites at once,
# 5 s twice left a few of the fuzzer's worker's last pushes unanswered (of about ten such runs; none alone, nor in
# five runs beside four CPU hogs). Runs that left them unanswered for the whole 30 s were shards dropping answers to
# the worker's connection, which MEMBER_WINDOW now prevents (`replies_fit`). A lie never answered is still caught,
# only later; the progress line after the fuzz says how long the last answers took.
STALL_S = 30.0
ATTACK_REPLY_S = 60.0  # a reported attack's refusal may take this long on a loaded machine (65,537 frames to read)
MEMBER_PULL_SEQ = 1 << 40  # the worker's own pulls are numbered from here, apart from the fuzzed messages' seqs
MEMBER_WINDOW = 16  # the worker's messages in flight on its own connection to a shard (`replies_fit`)
HEARTBEAT_S = 5.0  # the fuzzer's worker heartbeats this often, well within the job's --liveness-timeout-s
# Every shard moves this many versions between the fuzzer's first pull and its worker's enlistment (after which rounds
# wait for it): the worker learns the job's descent direction from that movement, and its lies are scaled from it.
# A shard that has not moved gives a zero gradient, and "noise" of 1e3 times that norm is no lie: the likely cause of
# one taken unclipped under two suites while only one shard had to have moved.
MOVED_VERSIONS = 20


@dataclass
class FuzzSettings:
    messages: int = 100_000
    seed: int = 0
    epochs: float = 3.0
    workers: int = 2
    shards: int = 2
    connections: int = 8  # per target
    window: int = 32  # messages in flight per connection
    clean: bool = True  # run the untouched reference job beside it
    # Until its worker holds a batch, the fuzzer races the job: it must learn the job and enlist before the job
    # ends. The jobs' workers run this much nicer than the fuzzer and the servers that answer it, so that on a
    # busy machine they do not train through the job while the fuzzer waits for the CPU ...
    worker_nice: int = 5
    # ... and idle this many times their compute (--slowdown): a job lasts longer for the same CPU, and under
    # load their compute, hence their idling, grows too.
    slowdown: float = 1.0


@dataclass
class FuzzReport:
    messages: int = 0
    seconds: float = 0.0
    messages_per_s: float = 0.0
    sent: dict[str, int] = field(default_factory=dict)  # by category
    refused: dict[str, int] = field(default_factory=dict)  # ERROR answers received, by code
    counted: dict[str, int] = field(default_factory=dict)  # growth of dynabatch_bad_messages_total, by code
    accepted: list[str] = field(default_factory=list)  # answers other than ERROR: accepted lies
    unanswered: int = 0
    unanswered_kinds: dict[str, int] = field(default_factory=dict)
    live_throughout: bool = False  # the job had not finished when the last message went
    epoch_at_end: float = 0.0  # the job's epoch then: how much of its length the fuzz took
    exited: list[str] = field(default_factory=list)  # processes that died (or exited non-zero)
    non_finite: list[str] = field(default_factory=list)  # shard chunks holding NaN or Inf
    attacks: list[AttackResult] = field(default_factory=list)  # the reported attacks, sent before the fuzz
    member: str = ""  # the fuzzer's own worker
    byzantine: dict[str, dict[str, int]] = field(default_factory=dict)  # its messages' answers, by kind and outcome
    member_counted: dict[str, Any] = field(default_factory=dict)  # what the shards counted of it
    byzantine_wrong: list[str] = field(default_factory=list)  # its messages answered as they must not be
    honest_failed: dict[str, int] = field(default_factory=dict)  # the job's own workers' failed steps, by worker
    fuzzed_acc: float | None = None
    clean_acc: float | None = None

    @property
    def ok(self) -> bool:
        return (
            self.live_throughout
            and not self.accepted
            and not self.unanswered_kinds
            and not self.exited
            and all(a.ok for a in self.attacks)
            and bool(self.byzantine)
            and not self.byzantine_wrong
            and not self.honest_failed
            and not self.non_finite
            and self.fuzzed_acc is not None
            and self.clean_acc is not None
            and abs(self.fuzzed_acc - self.clean_acc) * 100 <= ACCURACY_POINTS
            and all(self.counted.get(code, 0) >= n for code, n in self.refused.items())
        )


def renice(pid: int, priority: int) -> None:
    """Every thread of `pid` at `priority` (Linux's is per thread: a worker forked by the preloader has started
    its threads by the time this runs, and they would keep the priority they were created with)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), priority)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


class Job:
    """One job's processes; `name` prefixes their logs."""

    def __init__(self, log_dir: Path, name: str, settings: FuzzSettings) -> None:
        self.launcher = Launcher(log_dir, prefix=f"{name}-", preloader_socket=os.environ.get(PRELOADER_ENV, ""))
        flags = [*JOB, "--epochs", str(settings.epochs), "--shards", str(settings.shards), "--seed", str(settings.seed)]
        self.launcher.start_scheduler(flags)
        for i in range(settings.shards):
            self.launcher.start_shard(i, f"ps{i}", ["--log-level", "WARNING"])
        for i in range(settings.workers):
            self.launcher.start_worker(f"worker{i}", ["--log-level", "WARNING", "--slowdown", f"{settings.slowdown:g}"])
        self.launcher.start_worker("evaluator", ["--log-level", "WARNING"], evaluator=True)
        for child in self.children("worker") + self.children("evaluator"):
            renice(child.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + settings.worker_nice)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def status(self) -> JobStatus | None:
        frames = request(self.ctx, self.launcher.scheduler_endpoint, StatusRequest(), 2.0)
        return decode(frames[0]).body.state if frames else None

    def wait(self, what: str, predicate: Callable[[JobStatus], object], timeout_s: float) -> JobStatus:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failed = [c for c in self.launcher.children if c.proc.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"{failed[0].name} exited with {failed[0].proc.returncode}; its log ends:\n{failed[0].log_tail(40)}"
                )
            status = self.status()
            if status is not None and predicate(status):
                return status
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def children(self, role: str) -> list[Child]:
        return [c for c in self.launcher.children if c.role == role]

    def stop(self) -> None:
        self.launcher.stop_all()


def request(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    body: Any,
    timeout_s: float,
    sock: zmq.Socket[bytes] | None = None,
    sender: str = "fuzz",
    entries: int = 0,
) -> list[list[bytes]]:
    """Send `body` and return its raw answers (the frames as they came: the fuzzer replays them): one, or for a
    PULL as many as carry its `entries` chunk entries (or as came within `timeout_s`)."""
    conn = dealer(ctx, endpoint) if sock is None else sock
    try:
        conn.send_multipart(encode(Message(body, [], [], "dynabatch", sender, 1)))
        out: list[list[bytes]] = []
        got = 0
        deadline = time.monotonic() + timeout_s
        while (not out or got < entries) and conn.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            out.append([bytes(f) for f in conn.recv_multipart()])
            if entries:
                got += len(decode(out[-1]).chunks)
        return out
    finally:
        if sock is None:
            conn.close(linger=0)


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, reads: bool = True) -> zmq.Socket[bytes]:
    """A connection of its own; one that never `reads` takes one reply at most into its buffers."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not reads:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.ROUTING_ID, b"f" + secrets.token_bytes(15))
    sock.connect(endpoint)
    return sock


def learn(job: Job, status: JobStatus, sockets: list[list[zmq.Socket[bytes]]]) -> JobView:
    """What a peer can learn of the job: STATUS, what a PULL returns, and a registration of its own per connection."""
    endpoint = job.launcher.scheduler_endpoint
    captured = [request(job.ctx, endpoint, StatusRequest(), 5.0)[0]]
    ghosts: list[str] = []
    ghost_evals: list[str] = []
    config: dict[str, Any] | None = None
    for i, sock in enumerate(sockets[SCHEDULER]):
        for role, into in ((Role.WORKER, ghosts), (Role.EVALUATOR, ghost_evals)):
            frames = request(
                job.ctx, endpoint, Hello(role=role, name=f"fuzz-{role}{i}", instance=f"fuzz-{role}{i}"), 10.0, sock
            )[0]
            welcome = decode(frames).body
            assert isinstance(welcome, Welcome), f"the fuzzer's own {role} was not admitted: {welcome}"
            into.append(welcome.id)
            config = welcome.config
            captured.append(frames)
    assert config is not None, "the fuzzer has no member of its own"
    jobcfg = job_from_dict(config)
    init, flat = builtin_init(jobcfg)
    layout = make_layout(flat.numel(), jobcfg.chunk_bytes, jobcfg.shards)
    chunks, values = [], []
    for s, (_, shard) in enumerate(sorted(status.shards.items())):
        metas, tensors, answers = pull_all(
            job, shard.endpoint, sockets[s + 1][0], "fuzz-reader", len(layout.for_shard(s))
        )
        chunks.append(metas)
        values.append(tensors)
        captured.extend(answers[:2])
    hellos = [
        Hello(role=Role.SHARD, endpoint=shard.endpoint, shard_index=int(i))
        for i, shard in sorted(status.shards.items())
    ]
    heartbeats = {
        wid: WorkerHeartbeat(
            steps=w.steps,
            samples=w.samples,
            batch=w.batch,
            times=StepTimes(step_s=w.times.step_s),
            standalone_sps=w.standalone_sps,
        )
        for wid, w in status.workers.items()
    }
    return JobView(
        "dynabatch",
        sorted(status.workers),
        ["eval0"],
        hellos,
        chunks,
        captured,
        heartbeats,
        init,
        jobcfg.max_batch,
        max(s.version for s in status.shards.values()),
        ghosts,
        ghost_evals,
        len(sockets[SCHEDULER]),
        jobcfg.max_workers,
        values,
        base_lr(jobcfg),
    )


def pull_all(
    job: Job, endpoint: str, sock: zmq.Socket[bytes], sender: str, entries: int
) -> tuple[list[ChunkMeta], list[Any], list[list[bytes]]]:
    """Every chunk of a shard (`entries` of them) as `sender` pulls it on `sock`: entries, values (copies) and the
    raw answers."""
    answers = pull_answers(job.ctx, endpoint, sock, sender, entries)
    decoded = [decode(a) for a in answers]
    assert decoded and all(isinstance(m.body, Params) for m in decoded), f"{endpoint} answered PULL with {decoded}"
    metas = [ChunkMeta(c.id, c.dtype, c.shape, c.version) for m in decoded for c in m.chunks]
    return metas, [torch.as_tensor(t).clone() for m in decoded for t in m.tensors], answers


def enlist(
    job: Job, view: JobView, endpoints: list[str], sock: zmq.Socket[bytes], shard_socks: list[zmq.Socket[bytes]]
) -> ByzantineMember:
    """Register the fuzzer's own worker on `sock` and report a speed, so that it is admitted with a batch; pull
    the model on its own connections to the shards (`shard_socks`), which binds them to it, and measure the job's
    descent direction from the model's movement since `view` pulled it: (before - now) / (lr x versions)."""
    welcome = decode(
        request(job.ctx, "", Hello(role=Role.WORKER, name="fuzz-byzantine", instance="fuzz-byzantine"), 10.0, sock)[0]
    ).body
    assert isinstance(welcome, Welcome), f"the fuzzer's worker was not admitted: {welcome}"
    request(job.ctx, "", WorkerHeartbeat(standalone_sps=1000.0), 10.0, sock, welcome.id)
    status = job.wait(
        "the fuzzer's worker to hold a batch", lambda s: welcome.id in s.workers and s.workers[welcome.id].batch > 0, 60
    )
    metas, gradient = [], []
    for s, endpoint in enumerate(endpoints[1:]):
        now_metas, now, _ = pull_all(job, endpoint, shard_socks[s], welcome.id, len(view.chunks[s]))
        metas.append(now_metas)
        gradient.append(
            [
                (before - after) / (view.lr * max(1, m.version - m0.version))
                for before, after, m, m0 in zip(view.params[s], now, now_metas, view.chunks[s], strict=True)
            ]
        )
    return ByzantineMember(
        welcome.id, status.workers[welcome.id].batch, view.max_batch, view.connections, metas, gradient
    )


def attack(
    job: Job, view: JobView, endpoints: list[str], sockets: list[list[zmq.Socket[bytes]]], a: Attack, window: int = 32
) -> AttackResult:
    """Send attack `a` (see Attack for the connection it takes); the result says what came back, or how the
    target grew."""
    result = AttackResult(a.name)
    messages = a.messages(view)
    sock = sockets[a.target][0] if a.as_ghost else dealer(job.ctx, endpoints[a.target], a.reads)
    try:
        if not a.reads:
            return _unread(job, view, a, sock, messages, result)
        room = a.admits(view)
        answered, sent = 0, 0
        while answered < len(messages):
            while sent < len(messages) and sent - answered < window:
                sock.send_multipart(messages[sent])
                sent += 1
            if not sock.poll(int(ATTACK_REPLY_S * 1000)):
                result.wrong.append(f"no answer to {sent - answered} of its messages in {ATTACK_REPLY_S:.0f} s")
                break
            reply = decode(sock.recv_multipart())
            answered += 1
            if isinstance(reply.body, Error) and reply.body.code in a.refusals:
                result.refused[reply.body.code] = result.refused.get(reply.body.code, 0) + 1
            elif isinstance(reply.body, Welcome) and len(result.admitted) < room:
                result.admitted.append(reply.body.id)
            else:
                result.wrong.append(f"{reply.type} {getattr(reply.body, 'code', '')}".strip())
        result.sent = sent
        for member in result.admitted:  # a flood's members leave again, so that the fuzz meets the job as it was
            request(job.ctx, "", Bye(), 5.0, sock, member)
    finally:
        if not a.as_ghost:
            sock.close(linger=0)
    return result


def _unread(
    job: Job, view: JobView, a: Attack, sock: zmq.Socket[bytes], messages: list[list[bytes]], result: AttackResult
) -> AttackResult:
    """Pulls nobody reads: the shard must drop their replies, not hold them. Bound: a tenth of holding them all."""
    shard = job.children("ps")[a.target - 1]

    def handled() -> tuple[float, float]:  # answered, and refused once the connection's unread answers filled up
        return metric_sum(shard.metrics(), "dynabatch_ps_pulls_total"), bad_message_counts([shard])["busy"]

    before = handled()
    rss_before = rss_bytes(shard.proc.pid)
    for frames in messages:
        sock.send_multipart(frames)
    result.sent = len(messages)
    job.wait("the shard to handle the unread pulls", lambda s: sum(handled()) >= sum(before) + UNREAD_PULLS, 60)
    result.refused["busy"] = int(handled()[1] - before[1])  # counted by the shard: its ERRORs went unread
    result.grown_bytes = max(0, rss_bytes(shard.proc.pid) - rss_before)
    result.bound_bytes = UNREAD_PULLS * sum(4 * math.prod(c.shape) for c in view.chunks[a.target - 1]) // 10
    return result


def member_counts(shards: list[Child], member: str) -> dict[str, Any]:
    """What the shards counted of `member`: pushes taken, pushes clipped, and workers quarantined by reason."""
    texts = [c.metrics() for c in shards]
    return {
        "pushes": sum(metric_by_label(t, "dynabatch_ps_pushes_total", "worker")[member] for t in texts),
        "clipped": sum(metric_by_label(t, "dynabatch_ps_clipped_pushes_total", "worker")[member] for t in texts),
        "quarantined": dict(
            sum((metric_by_label(t, "dynabatch_ps_quarantined_workers_total", "reason") for t in texts), Counter())
        ),
    }


def honest_failures(job: Job) -> dict[str, int]:
    """The job's own workers' failed steps (each logs "step failed"), by worker: none of the fuzz's messages may cost
    an honest worker a step. Before fe575da the fuzzer's worker, enlisting among two, had the direction check hold
    the others back, and they failed one step in two to four, refused "already pushed", for the rest of the job."""
    failed = {c.name: c.log_path.read_text(errors="replace").count("step failed (") for c in job.children("worker")}
    return {name: n for name, n in failed.items() if n}


def bad_message_counts(children: list[Child]) -> Counter[str]:
    """Refusals counted by `children`, by code."""
    return sum((metric_by_label(c.metrics(), "dynabatch_bad_messages_total", "reason") for c in children), Counter())


def pull_answers(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, sock: zmq.Socket[bytes] | None, sender: str, entries: int
) -> list[list[bytes]]:
    """A PULL's raw answers, until they carry the shard's `entries` chunks."""
    return request(ctx, endpoint, Pull(), 10.0, sock, sender, entries)


def finite_check(job: Job, status: JobStatus, view: JobView) -> list[str]:
    """Every chunk of every shard, pulled as a reader: the names of those holding a NaN or Inf."""
    bad = []
    for (index, shard), entries in zip(sorted(status.shards.items()), view.chunks, strict=True):
        answers = pull_answers(job.ctx, shard.endpoint, None, "fuzz-check", len(entries))
        if not answers:
            bad.append(f"shard {index}: no answer to the check's PULL")
        for frames in answers:
            msg = decode(frames)
            for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
                if not torch.isfinite(tensor).all():
                    bad.append(f"shard {index} chunk {meta.id}")
    return bad


def replies_fit(window: int, chunks: int) -> bool:
    """Whether the answers the fuzzer's worker may leave unread on its connection to a shard of `chunks` chunks
    (`window` messages in flight, and one pull's chunks) fit in the backlog that shard keeps for one connection
    (ps/outbox.py), as an honest worker's always do. ZeroMQ's queue in front of it does not count: it refuses a
    message while its reader's word that it sent the earlier ones is late, as on a busy machine. With 32 in flight
    beside a second suite, a shard of 4 chunks dropped 6 answers to the worker's pushes after a backlog of 26
    refusals and a pull's 4 chunks, though at most 36 of the worker's messages were unanswered: the fuzz took them for
    lies left unanswered."""
    return window + chunks <= backlog_limit(chunks)


class Fuzzer:
    """Sends the messages with a bounded window per connection and tallies the answers; those to the fuzzer's
    worker by kind, and the PUSHes a shard took from it into its pool of replays."""

    def __init__(self, sockets: list[list[zmq.Socket[bytes]]], window: int, member: ByzantineMember) -> None:
        self.sockets = sockets
        self.window = window
        self.in_flight = {id(s): 0 for row in sockets for s in row}
        self.last_answer = {id(s): time.monotonic() for row in sockets for s in row}
        self.poller = zmq.Poller()
        for row in sockets:
            for s in row:
                self.poller.register(s, zmq.POLLIN)
        self.refused: Counter[str] = Counter()
        self.accepted: list[str] = []
        self.kinds: dict[int, str] = {}
        self.written_off = 0
        self.member = member
        # the worker's in flight: (connection, seq) -> kind, shard, frames
        self.pushes: dict[tuple[int, int], tuple[str, int, list[bytes]]] = {}
        self.byzantine: dict[str, Counter[str]] = {}  # the worker's answered, by kind: "taken" or the refusal's code
        self.member_pulls: dict[int, int] = {}  # the worker's pulls: seq -> shard (a pull may take several answers)
        # shards whose pull by the worker is not answered in full yet: the chunks still to come (`replies_fit`)
        self.pulling: dict[int, int] = {}
        self.pull_seq = MEMBER_PULL_SEQ

    def send(self, target: int, connection: int, frames: list[bytes], seq: int, what: str) -> None:
        sock = self.sockets[target][connection]
        window = MEMBER_WINDOW if connection == self.member.connection else self.window
        while self.in_flight[id(sock)] >= window:
            self.collect(0.05)
            if self.in_flight[id(sock)] >= window and time.monotonic() - self.last_answer[id(sock)] > STALL_S:
                self.written_off += self.in_flight[id(sock)]
                self.in_flight[id(sock)] = 0
        if what.split()[0] in BYZANTINE:  # by connection: a taken PUSH is replayed under its seq on two of them
            self.pushes[(id(sock), seq)] = (what.split()[1], target - 1, frames)
        elif seq >= 0 and what.split()[0] in LIES:  # a lie is well-formed: its refusal names its seq
            self.kinds[seq] = what
        sock.send_multipart(frames)
        self.in_flight[id(sock)] += 1

    def collect(self, timeout_s: float) -> None:
        for sock, _ in self.poller.poll(int(timeout_s * 1000)):
            while sock.poll(0):
                frames = sock.recv_multipart()
                self.last_answer[id(sock)] = time.monotonic()
                try:
                    msg = decode(frames)
                except ProtocolError as exc:
                    msg = None
                    self.accepted.append(f"an undecodable answer ({exc})")
                if msg is not None and msg.seq in self.member_pulls:  # outside the window: not counted in flight
                    shard = self.member_pulls[msg.seq]
                    if isinstance(msg.body, Params):
                        self.member.pulled(shard, list(msg.chunks))
                        self.pulling[shard] = self.pulling.get(shard, 0) - len(msg.chunks)
                    if not isinstance(msg.body, Params) or self.pulling[shard] <= 0:
                        self.pulling.pop(shard, None)
                    continue
                self.in_flight[id(sock)] = max(0, self.in_flight[id(sock)] - 1)
                if msg is None:
                    continue
                pushed = self.pushes.pop((id(sock), msg.seq), None)
                if pushed is not None:
                    self._tally(pushed, msg)
                    continue
                what = self.kinds.pop(msg.seq, "an untracked message")
                if isinstance(msg.body, Error):
                    self.refused[msg.body.code] += 1
                else:
                    self.accepted.append(f"{msg.type} answering {what}")

    def _tally(self, pushed: tuple[str, int, list[bytes]], msg: Message[Any]) -> None:
        """The answer to one of the worker's messages: a refusal by its code, or taken (a gradient taken goes
        into the pool of replays)."""
        kind, shard, frames = pushed
        if isinstance(msg.body, Error):
            if msg.body.code not in (ErrorCode.TOO_STALE, ErrorCode.HELD):  # discarded or held: counted apart
                self.refused[msg.body.code] += 1
            outcome = msg.body.code
        else:
            outcome = "taken" if isinstance(msg.body, PushAck) else msg.type
        self.byzantine.setdefault(kind, Counter())[outcome] += 1
        if outcome == "taken" and kind in GRADIENTS:
            self.member.took(shard, msg.seq, frames)
        elif outcome in ("too_stale", "held") and shard not in self.pulling:
            self._pull(shard)

    def _pull(self, shard: int) -> None:
        """The worker pulls `shard`'s model again on its own connection, as an honest one does after a discarded
        gradient, to learn the versions its next pushes are based on."""
        self.pull_seq += 1
        self.member_pulls[self.pull_seq] = shard
        self.pulling[shard] = len(self.member.metas[shard])
        self.sockets[shard + 1][self.member.connection].send_multipart(
            encode(Message(Pull(), [], [], "dynabatch", self.member.id, self.pull_seq))
        )

    def drain(self) -> None:
        """Collect answers until none is in flight, or none has come for STALL_S (a loaded machine answers late)."""
        while sum(self.in_flight.values()) and time.monotonic() - max(self.last_answer.values()) < STALL_S:
            self.collect(0.1)

    def unanswered(self) -> int:
        return self.written_off + sum(self.in_flight.values())

    def unanswered_kinds(self) -> Counter[str]:
        """The tracked messages no answer came for, by category and type (an EVAL taken is not answered)."""
        return Counter(self.kinds.values()) + Counter(f"byzantine {kind}" for kind, _, _ in self.pushes.values())


def fuzz(settings: FuzzSettings, log_dir: Path, progress: Callable[[str], None] = print) -> FuzzReport:
    """Run the fuzzed job (and the clean one beside it) to their ends; the report says what happened."""
    report = FuzzReport()
    target = Job(log_dir, "fuzzed", settings)
    clean = Job(log_dir, "clean", settings) if settings.clean else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sockets: list[list[zmq.Socket[bytes]]] = []
    own: list[zmq.Socket[bytes]] = []  # the fuzzer's worker's connection to the scheduler
    try:
        status = target.wait(
            "the fuzzed job to train",
            lambda s: (
                len(s.workers) == settings.workers
                and all(w.steps > 2 for w in s.workers.values())
                and len(s.shards) == settings.shards
            ),
            180,
        )
        endpoints = [target.launcher.scheduler_endpoint] + [s.endpoint for _, s in sorted(status.shards.items())]
        sockets = [[dealer(ctx, ep) for _ in range(settings.connections)] for ep in endpoints]
        view = learn(target, status, sockets)
        target.wait(
            "the model to move since the fuzzer pulled it",
            lambda s: min(shard.version for shard in s.shards.values()) >= view.version + MOVED_VERSIONS,
            120,
        )
        servers = target.children("scheduler") + target.children("ps")
        counted_before = bad_message_counts(servers)
        for a in ATTACKS:
            began = time.monotonic()
            report.attacks.append(attack(target, view, endpoints, sockets, a))
            r = report.attacks[-1]
            progress(
                f"[fuzz] attack {a.name!r} ({time.monotonic() - began:.1f} s): {r.sent} sent, refused "
                f"{r.refused}, {len(r.admitted)} admitted"
                + (
                    f", shard grew {r.grown_bytes / 1e6:.1f} MB (bound {r.bound_bytes / 1e6:.1f})"
                    if not a.reads
                    else ""
                )
                + (f"; WRONG: {sorted(set(r.wrong))}" if r.wrong else "")
            )
        # The worker enlists after the attacks: from then on every round waits for its push, and the attacks push
        # nothing of its own. Enlisted before them, it held the honest workers' pulls for as long as the attacks took:
        # 29 s under two suites, and their steps failed at the workers' 30 s request timeout.
        member_sock = dealer(ctx, endpoints[SCHEDULER])
        own.append(member_sock)
        for row, endpoint in zip(sockets[1:], endpoints[1:], strict=True):
            row.append(dealer(ctx, endpoint))  # column view.connections: the worker's own connection to each shard
        began = time.monotonic()
        member = enlist(target, view, endpoints, member_sock, [row[-1] for row in sockets[1:]])
        report.member = member.id
        assert all(replies_fit(MEMBER_WINDOW, len(metas)) for metas in member.metas), (
            f"a window of {MEMBER_WINDOW} leaves the worker more answers unread than a shard keeps for one connection"
        )
        progress(
            f"[fuzz] the fuzzer's worker {member.id} holds a batch of {member.batch}: every round waits for it "
            f"from version {min(m.version for ms in member.metas for m in ms)} on "
            f"({time.monotonic() - began:.1f} s)"
        )
        beat = Heartbeats(ctx, member_sock, member.id)
        messages = FuzzMessages(view, random.Random(settings.seed), member)
        fuzzer = Fuzzer(sockets, settings.window, member)
        sent: Counter[str] = Counter()
        start = last_report = time.monotonic()
        for n in range(1, settings.messages + 1):
            m = messages.make()
            fuzzer.send(m.target, m.connection, m.frames, m.seq, f"{m.category} {m.kind}")
            sent[m.category] += 1
            if n % 500 == 0:
                fuzzer.collect(0)
                beat.due()
                if time.monotonic() - last_report > 5 or n == settings.messages:
                    last_report = time.monotonic()
                    refused = sum(fuzzer.refused.values())
                    taken = sum(got["taken"] for got in fuzzer.byzantine.values())
                    progress(
                        f"[fuzz] {n}/{settings.messages} sent, {n / (last_report - start):.0f} messages/s, "
                        f"{refused} refused, {len(fuzzer.accepted)} accepted, {fuzzer.written_off} unanswered, "
                        f"{taken} of the worker's gradients taken"
                    )
                    dead = [c.name for c in target.launcher.children if not c.alive()]
                    if dead:
                        report.exited = dead
                        break
        drained = time.monotonic()
        fuzzer.drain()
        progress(
            f"[fuzz] the last answers came {time.monotonic() - drained:.1f} s after the last message, "
            f"{fuzzer.unanswered()} unanswered"
        )
        try:  # the counts first: a job near its end may outlast the checks after them, not these
            after = bad_message_counts(servers)
            report.member_counted = member_counts(target.children("ps"), member.id)
            request(ctx, "", Bye(), 2.0, member_sock, member.id)  # rounds wait for it no longer
            now = target.status()
        except OSError:  # a server's /metrics is gone: the job ended under the fuzz
            after, now = Counter(), None
        report.live_throughout = now is not None and not now.stopping
        if now is not None:
            report.epoch_at_end = now.epoch
            progress(f"[fuzz] the fuzz ended at epoch {now.epoch:.2f} of the job's {settings.epochs}")
        if now is None or not report.live_throughout:
            progress("[fuzz] the job finished before the fuzz did: give it more --epochs")
            return report
        report.seconds = time.monotonic() - start
        report.messages = sum(sent.values())
        report.messages_per_s = report.messages / report.seconds
        report.sent = dict(sent)
        report.refused = dict(fuzzer.refused + sum((Counter(a.refused) for a in report.attacks), Counter()))
        report.accepted = sorted(set(fuzzer.accepted))[:50]
        report.unanswered = fuzzer.unanswered()
        report.unanswered_kinds = dict(fuzzer.unanswered_kinds())
        report.byzantine = {kind: dict(got) for kind, got in sorted(fuzzer.byzantine.items())}
        report.byzantine_wrong = judge(
            report.byzantine, report.member_counted["pushes"], report.member_counted["clipped"]
        )
        report.exited = [c.name for c in target.launcher.children if not c.alive()]
        report.non_finite = finite_check(target, now, view)
        report.counted = {
            code: after[code] - counted_before[code] for code in after if after[code] > counted_before[code]
        }
        for i, sock in enumerate(sockets[SCHEDULER]):  # the fuzzer's ghosts leave, as honest members do
            for ghost in (view.ghost_workers[i], view.ghost_evaluators[i]):
                request(ctx, "", Bye(), 2.0, sock, ghost)
        report.fuzzed_acc = _final_accuracy(target, settings)
        report.exited += [c.name for c in target.launcher.children if c.proc.poll() not in (None, 0)]
        report.honest_failed = honest_failures(target)
        if clean is not None:
            report.clean_acc = _final_accuracy(clean, settings)
        progress(f"[fuzz] final accuracy {report.fuzzed_acc}, the clean twin's {report.clean_acc}")
    finally:
        for s in [*own, *(s for row in sockets for s in row)]:
            s.close(linger=0)
        target.stop()
        if clean is not None:
            clean.stop()
    return report


class Heartbeats:
    """The fuzzer's worker heartbeats every HEARTBEAT_S, as an honest one does, so that the job keeps it (and every
    round waits for its push) until it says BYE."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], member: str) -> None:
        self.ctx, self.sock, self.member = ctx, sock, member
        self.last = time.monotonic()

    def due(self) -> None:
        if time.monotonic() - self.last > HEARTBEAT_S:
            self.last = time.monotonic()
            request(self.ctx, "", WorkerHeartbeat(standalone_sps=1000.0), HEARTBEAT_S, self.sock, self.member)


def _final_accuracy(job: Job, settings: FuzzSettings) -> float | None:
    status = job.wait(
        "the job to finish with a final evaluation", lambda s: s.finished and s.final_eval, 120 + 60 * settings.epochs
    )
    return status.test_acc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m fuzz", description=__doc__.split("\n\n")[0])
    defaults = FuzzSettings()
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--epochs",
        type=float,
        default=defaults.epochs,
        help="the job's length: long enough that it is still training when the last message goes",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=defaults.slowdown,
        help="the jobs' workers idle this many times their compute (a longer job for the CPU)",
    )
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--shards", type=int, default=defaults.shards)
    parser.add_argument("--no-clean", action="store_true", help="skip the clean reference job (no accuracy check)")
    parser.add_argument("--out", default="", help="folder for the logs and fuzz.json (default: a temporary one)")
    args = parser.parse_args(argv)
    settings = FuzzSettings(
        args.messages,
        args.seed,
        args.epochs,
        args.workers,
        args.shards,
        clean=not args.no_clean,
        slowdown=args.slowdown,
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="dynabatch-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    report = fuzz(settings, out / "logs", lambda line: print(line, flush=True))
    (out / "fuzz.json").write_text(json.dumps(asdict(report), indent=2))
    print(json.dumps(asdict(report), indent=2))
    print(
        f"{'OK' if report.ok else 'FAILED'}: {report.messages} messages in {report.seconds:.1f} s "
        f"({report.messages_per_s:.0f}/s); accuracy {report.fuzzed_acc} fuzzed vs {report.clean_acc} clean; "
        f"the worker's messages {report.byzantine}, counted by the shards {report.member_counted}"
        + (f", WRONG: {report.byzantine_wrong}" if report.byzantine_wrong else "")
        + "; "
        f"report in {out / 'fuzz.json'}"
    )
    return 0 if report.ok else 1
