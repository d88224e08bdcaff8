"""The fuzz suite's messages: garbage, and well-formed messages that lie, built from what a live job looks like.

Pure: `FuzzMessages.make` turns a random draw and a `JobView` (the job's real
member ids, shard chunks and captured real messages) into the frames of one
message, its target (the scheduler or a shard), the connection it must travel
on, and its category. Three of the categories are malformed (random bytes,
truncated real messages, fields of the wrong type) and five are well-formed
lies: another member's name, numbers out of bounds from the fuzzer's own
registered ghosts, replays of captured real messages, and what the fuzzer's own
live worker (fuzz/byzantine.py) can send: Byzantine gradients, and its own
accepted PUSHes again. Every message but those gradients is one the receiver
must refuse: a reply other than ERROR is an accepted lie; a Byzantine gradient
may be taken, bounded (fuzz/run.py judges which).
"""

from __future__ import annotations

import dataclasses
import random
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack

from dynabatch.common.wire.frames import PROTOCOL_VERSION, ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Bye, EvalReport, Hello, Init, Pull, Push, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from fuzz.byzantine import GRADIENTS, ByzantineMember

SCHEDULER = 0  # target index; shard s is target s + 1
MALFORMED = ("garbage", "truncated", "mistyped")
BYZANTINE = ("byzantine", "push_replay")  # from the fuzzer's live worker, to the shards
LIES = ("wrong_sender", "out_of_bounds", "replay", *BYZANTINE)
CATEGORIES = MALFORMED + LIES
HUGE = 2**62


@dataclass
class JobView:
    """What the fuzzer learned of the live job before it started, all of it as a real peer could learn it."""

    job: str
    workers: list[str]  # live workers' ids
    evaluators: list[str]
    shard_hellos: list[Hello]  # each shard's registration, as the shard sent it
    chunks: list[list[ChunkMeta]]  # per shard, as a PULL returned them
    # Real messages seen on the fuzzer's own connections (PARAMS, STATUS_REPLY, WELCOME ...).
    captured: list[list[bytes]]
    heartbeats: dict[str, WorkerHeartbeat]  # each live worker's last reported numbers (from STATUS)
    init: Init  # the job's real model signature
    max_batch: int
    version: int  # the newest model version the shards hold
    ghost_workers: list[str]  # the worker the fuzzer registered on scheduler connection i (its own, honestly)
    ghost_evaluators: list[str]
    connections: int  # per target
    max_workers: int  # the job's --max-workers
    params: list[list[Any]] = field(default_factory=list)  # per shard, the chunks' values as the PULL returned them
    lr: float = 0.0  # the job's step size (common/base_lr.py), to tell a gradient from the model's movement

    @property
    def members(self) -> list[str]:
        return [*self.workers, *self.evaluators, *(f"ps{i}" for i in range(len(self.shard_hellos)))]


# A drawn message: a body in someone's name (its chunk entries, tensors and sender), or raw frames already (the
# type they claim, "" if none, and their seq, -1 where none is readable).
Lie = tuple[Hello | WorkerHeartbeat | Bye | EvalReport | Pull | Push | Init, list[ChunkMeta], list[Any], str]
Drawn = Lie | tuple[list[bytes], str, None, int]


@dataclass
class FuzzMessage:
    target: int
    connection: int
    frames: list[bytes]
    category: str
    kind: str  # the message type it claims to be, or "bytes"
    seq: int  # -1 where the frames carry no readable seq


@dataclass
class FuzzMessages:
    """Draws messages; `seq` numbers them so that replies can be matched."""

    view: JobView
    rng: random.Random
    member: ByzantineMember
    seq: int = field(default=1_000_000)

    def make(self) -> FuzzMessage:
        category = self.rng.choice(CATEGORIES)
        self.seq += 1
        if category in BYZANTINE:
            return self._from_member(category)
        target = self.rng.randrange(1 + len(self.view.chunks)) if self.rng.random() < 0.5 else SCHEDULER
        connection = self.rng.randrange(self.view.connections)
        body, chunks, tensors, sender = getattr(self, f"_{category}")(target, connection)
        if isinstance(body, list):  # raw frames already
            return FuzzMessage(target, connection, body, category, chunks or "bytes", sender)
        frames = [bytes(f) for f in encode(Message(body, chunks, tensors, self.view.job, sender, self.seq))]
        return FuzzMessage(target, connection, frames, category, body.TYPE, self.seq)

    def _from_member(self, category: str) -> FuzzMessage:
        """A Byzantine gradient from the member's own connection, or one of its taken PUSHes again, on that
        connection or another; `kind` names the lie (fuzz/byzantine.py)."""
        m = self.member
        shard = self.rng.randrange(len(self.view.chunks))
        taken = m.replay(shard, self.rng) if category == "push_replay" else None
        if taken is not None:
            seq, frames, kind = taken
            connection = (
                m.connection
                if kind == "replay_own"
                else self.rng.choice([c for c in range(self.view.connections) if c != m.connection])
            )
            return FuzzMessage(shard + 1, connection, list(frames), category, kind, seq)
        kind = self.rng.choice(GRADIENTS)  # nothing taken on that shard yet: a gradient instead
        body, metas, tensors = m.push(kind, shard, self.rng)
        frames = [bytes(f) for f in encode(Message(body, metas, tensors, self.view.job, m.id, self.seq))]
        return FuzzMessage(shard + 1, m.connection, frames, "byzantine", kind, self.seq)

    # -- malformed ------------------------------------------------------------

    def _garbage(self, target: int, connection: int) -> Drawn:
        frames = [self.rng.randbytes(self.rng.choice((0, 1, 7, 64, 500))) for _ in range(self.rng.randint(1, 4))]
        if self.rng.random() < 0.3:  # a msgpack map that is no envelope
            frames[0] = msgpack.packb({self.rng.choice(("v", "type", 7, b"x")): self.rng.randbytes(4)})
        return frames, "", None, -1

    def _truncated(self, target: int, connection: int) -> Drawn:
        body, chunks, tensors, sender = self._wrong_sender(target, connection)
        frames = [bytes(f) for f in encode(Message(body, chunks, tensors, self.view.job, sender, self.seq))]
        cut = self.rng.randrange(3)
        if cut == 0 or len(frames) == 1:
            frames[0] = frames[0][: self.rng.randrange(max(1, len(frames[0])))]
            return frames, body.TYPE, None, -1
        if cut == 1:
            del frames[self.rng.randrange(1, len(frames))]
        else:
            i = self.rng.randrange(1, len(frames))
            frames[i] = frames[i][: self.rng.randrange(max(1, len(frames[i])))]
        return frames, body.TYPE, None, self.seq

    def _mistyped(self, target: int, connection: int) -> Drawn:
        body, chunks, tensors, sender = self._wrong_sender(target, connection)
        envelope = msgpack.unpackb(encode(Message(body, chunks, tensors, self.view.job, sender, self.seq))[0])
        hints = typing.get_type_hints(type(body))
        names = [f.name for f in dataclasses.fields(body) if hints[f.name] is not Any]
        choice = self.rng.randrange(len(names) + 4)
        if choice < len(names):
            envelope[names[choice]] = self.rng.choice(_wrong_values(hints[names[choice]]))
        elif choice == len(names):
            envelope["v"] = self.rng.choice((0, PROTOCOL_VERSION + 1, "1", None))
        elif choice == len(names) + 1:
            envelope["type"] = self.rng.choice(("EXPLODE", "", 7, None, "ASSIGNMENT", "WELCOME"))
        elif choice == len(names) + 2:
            envelope["seq"] = self.rng.choice(("1", 1.5, None, [1]))
        else:
            envelope["chunks"] = self.rng.choice(
                ([{"id": "x"}], "chunks", [{"id": 0, "dtype": "complex64", "shape": [1], "version": 0}])
            )
        return (
            [msgpack.packb(envelope), *(bytes(memoryview(t.numpy()).cast("B")) for t in tensors)],
            body.TYPE,
            None,
            self.seq,
        )

    # -- well-formed lies -------------------------------------------------------

    def _wrong_sender(self, target: int, connection: int) -> Lie:
        """A message in a real member's name, from a connection that is not theirs."""
        v = self.view
        victim = self.rng.choice(v.members)
        if target == SCHEDULER:
            body = self.rng.choice(
                (
                    v.heartbeats.get(victim)
                    or WorkerHeartbeat(steps=1, samples=1, batch=1, times=StepTimes(step_s=0.1)),
                    Bye(),
                    EvalReport(version=v.version, test_loss=0.01, test_acc=0.999),
                )
            )
            return body, [], [], victim
        chunks = v.chunks[target - 1]
        kind = self.rng.randrange(3)
        victim = self.rng.choice(v.workers)
        if kind == 0:
            return Pull(ids=[c.id for c in chunks]), [], [], victim
        if kind == 1:
            return v.init, [], [], victim
        metas, tensors = zero_chunks(chunks)
        return Push(samples=self.rng.randint(1, v.max_batch)), metas, tensors, victim

    def _out_of_bounds(self, target: int, connection: int) -> Lie:
        """From the fuzzer's own ghost, or to a shard, numbers no honest peer can send."""
        v = self.view
        if target == SCHEDULER:
            if self.rng.random() < 0.25:  # NaN is an evaluator's honest mark for a diverged model: not a lie
                report = EvalReport(version=0, test_loss=0.1, test_acc=0.5)
                report = self.rng.choice(
                    (
                        dataclasses.replace(report, version=v.version + HUGE // 2),
                        dataclasses.replace(report, version=-1),
                        dataclasses.replace(report, test_acc=float("inf")),
                        dataclasses.replace(report, test_loss=float("-inf")),
                        dataclasses.replace(report, metrics={"x": float("inf")}),
                        dataclasses.replace(report, metrics={f"m{i}": 0.5 for i in range(33)}),
                        dataclasses.replace(report, metrics={self.rng.choice(("", "x" * 65, " pad", "a\nb")): 0.5}),
                    )
                )
                return report, [], [], v.ghost_evaluators[connection]
            return _impossible_heartbeat(self.rng, v.max_batch), [], [], v.ghost_workers[connection]
        chunks = v.chunks[target - 1]
        metas, tensors = zero_chunks(chunks)
        sender = self.rng.choice((*v.workers, v.ghost_workers[connection]))
        lie = self.rng.randrange(4)
        if lie == 0:
            return Push(samples=self.rng.choice((0, -1, HUGE, v.max_batch * 10**6))), metas, tensors, sender
        if lie == 1:
            metas = [dataclasses.replace(m, version=m.version + self.rng.randint(1, HUGE)) for m in metas]
        elif lie == 2:
            tensors[0][self.rng.randrange(tensors[0].numel())] = self.rng.choice((float("nan"), float("inf")))
        else:
            return Pull(ids=[self.rng.choice((-1, HUGE, 10**6))], min_version=self.rng.choice((0, -5))), [], [], sender
        return Push(samples=1), metas, tensors, sender

    def _replay(self, target: int, connection: int) -> Drawn:
        """A real message again: what the fuzzer captured, or what a member sent at registration."""
        v = self.view
        if self.rng.random() < 0.5:
            return list(self.rng.choice(v.captured)), "captured", None, -1
        if target == SCHEDULER:
            index = self.rng.randrange(len(v.shard_hellos))
            return v.shard_hellos[index], [], [], f"ps{index}"
        return self._wrong_sender(target, connection)


def zero_chunks(chunks: list[ChunkMeta]) -> tuple[list[ChunkMeta], list[Any]]:
    """`chunks` with a zero tensor each: a push that passes every check but who may send it."""
    import torch

    return list(chunks), [torch.zeros(c.shape) for c in chunks]


def _impossible_heartbeat(rng: random.Random, max_batch: int) -> WorkerHeartbeat:
    """A heartbeat with sane numbers but one field that cannot be true."""
    hb = WorkerHeartbeat(
        steps=1, samples=1, batch=1, times=StepTimes(step_s=0.1, compute_s=0.05), standalone_sps=1000.0
    )
    field_name, value = rng.choice(
        (
            ("times.step_s", float("nan")),
            ("times.step_s", float("inf")),
            ("times.compute_s", -1.0),
            ("times.wait_s", 1e9),
            ("batch", max_batch + 1),
            ("batch", -3),
            ("standalone_sps", 1e-9),
            ("standalone_sps", 1e12),
            ("steps", HUGE),
            ("samples", HUGE),
            ("samples", -1),
            ("steps", -1),
        )
    )
    nested, _, name = field_name.rpartition(".")
    lie: dict[str, Any] = {name: value}
    if nested:  # a lie in the heartbeat's step times
        return dataclasses.replace(hb, times=dataclasses.replace(hb.times, **lie))
    return dataclasses.replace(hb, **lie)


def _wrong_values(hint: Any) -> list[Any]:
    """Values of another type than `hint` (never None where None is allowed)."""
    origin = typing.get_origin(hint)
    optional = origin in (typing.Union, __import__("types").UnionType)
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    base = origin or hint
    wrong = {
        int: ["many", 1.5, [1], {"a": 1}, True],
        float: ["fast", [1.0], {"a": 1}, True],
        str: [5, [1], {"a": 1}, 1.5],
        bool: ["yes", 5, [1]],
        list: ["abc", 5, {"a": 1}],
        dict: ["abc", 5, [1]],
    }.get(base, ["abc", 5])
    if dataclasses.is_dataclass(base):  # a nested part (a heartbeat's times): no map, or a map with a field mistyped
        first = dataclasses.fields(base)[0].name
        wrong = ["abc", 5, [1], {first: _wrong_values(typing.get_type_hints(base)[first])[0]}]
    return wrong if optional else [*wrong, None]
