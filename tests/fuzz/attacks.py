"""The attacks issue 11 reported, one by one, as the fuzz sends them to a live job before its random messages.

Pure: each `Attack` turns the `JobView` into the frames it sends and says what
the receiver must answer. Each is a well-formed message (or burst) that once
wrecked a job: a PUSH in another worker's name with 2**62 samples, a HELLO flood,
a HEARTBEAT claiming 10**12 samples or a speed of 5e-324, an EVAL of version
2**62, a HELLO for a live shard's slot, BYEs in other workers' names, messages of
many large frames, a PUSH of 65,536 empty chunk entries, and pulls that are never
read. The fuzz (fuzz/run.py) runs them against the job it compares with a clean
one, so the final accuracy within one point covers every attack as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynabatch.common.wire.frames import MAX_CHUNKS, ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Bye, EvalReport, Hello, Pull, Push, Role, WorkerHeartbeat
from dynabatch.common.wire.step_times import StepTimes
from fuzz.messages import HUGE, SCHEDULER, JobView, zero_chunks

if TYPE_CHECKING:
    import torch

HELLO_FLOOD = 2000
LARGE_FRAMES = 16  # frames of LARGE_FRAME_BYTES in each of LARGE_MESSAGES messages, to each target
LARGE_FRAME_BYTES = 1 << 20
LARGE_MESSAGES = 4
UNREAD_PULLS = 1000
SIZE_REFUSALS = frozenset({"too_large", "bad_chunk", "malformed"})


@dataclass(frozen=True)
class Attack:
    """One reported attack: what it sends, to which target, and what each message must be answered with.

    `admits` is how many answers may be something other than a refusal (the
    room a HELLO flood may fill: bounded, not refused). An attack that does not
    read its answers (`reads` False) is judged by the target's memory instead.
    One `as_ghost` lies in the name of the fuzzer's own registered member, on
    the connection that registered it (connection 0): an honest sender's own
    impossible numbers. Any other comes from a connection of its own.
    """

    name: str
    target: int
    refusals: frozenset[str]
    messages: Callable[[JobView], list[list[bytes]]]
    admits: Callable[[JobView], int] = lambda view: 0
    reads: bool = True
    as_ghost: bool = False


@dataclass
class AttackResult:
    name: str
    sent: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by code
    admitted: list[str] = field(default_factory=list)  # ids welcomed by a flood, within its room
    wrong: list[str] = field(default_factory=list)  # answers it must not get, or none where one was due
    grown_bytes: int = 0  # the target's growth in memory, for an attack that reads no answer
    bound_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.wrong and self.grown_bytes <= self.bound_bytes


def _frames(
    view: JobView,
    body: object,
    sender: str,
    seq: int,
    metas: Sequence[ChunkMeta] = (),
    tensors: Sequence[torch.Tensor] = (),
) -> list[bytes]:
    return [bytes(f) for f in encode(Message(body, list(metas), list(tensors), view.job, sender, seq))]


def _push_as_another_worker(view: JobView) -> list[list[bytes]]:
    metas, tensors = zero_chunks(view.chunks[0])
    return [_frames(view, Push(samples=HUGE), view.workers[0], 1, metas, tensors)]


def _hello_flood(view: JobView) -> list[list[bytes]]:
    return [
        _frames(view, Hello(role=Role.WORKER, name=f"flood{i}", instance=f"flood{i}"), "flood", i + 1)
        for i in range(HELLO_FLOOD)
    ]


def flood_room(view: JobView) -> int:
    """Members the job may still admit: --max-workers less every worker and evaluator registered when the fuzzer
    learned the job (its own worker enlists after the attacks)."""
    return (
        view.max_workers
        - len(view.workers)
        - len(view.evaluators)
        - len(view.ghost_workers)
        - len(view.ghost_evaluators)
    )


def _heartbeat_of_1e12_samples(view: JobView) -> list[list[bytes]]:
    return [
        _frames(
            view,
            WorkerHeartbeat(steps=1, samples=10**12, batch=1, times=StepTimes(step_s=0.1), standalone_sps=1000.0),
            view.ghost_workers[0],
            1,
        )
    ]


LYING_EVAL = EvalReport(version=HUGE, test_loss=0.01, test_acc=0.999)


def _eval_of_version_2e62(view: JobView) -> list[list[bytes]]:
    return [_frames(view, LYING_EVAL, view.ghost_evaluators[0], 1)]


def _eval_in_a_workers_name(view: JobView) -> list[list[bytes]]:
    return [_frames(view, LYING_EVAL, view.workers[0], 1)]


def _speed_of_5e_324(view: JobView) -> list[list[bytes]]:
    return [_frames(view, WorkerHeartbeat(standalone_sps=5e-324), view.ghost_workers[0], 1)]


def _hello_as_shard_0(view: JobView) -> list[list[bytes]]:
    return [
        _frames(
            view,
            Hello(role=Role.SHARD, endpoint="tcp://127.0.0.1:1", shard_index=0, instance="impostor"),
            "impostor",
            1,
        )
    ]


def _byes_in_other_names(view: JobView) -> list[list[bytes]]:
    return [_frames(view, Bye(), member, i + 1) for i, member in enumerate([*view.workers, *view.evaluators])]


def _many_large_frames(view: JobView, body: object) -> list[list[bytes]]:
    """`body` with LARGE_FRAMES frames of a chunk's id, each LARGE_FRAME_BYTES long, LARGE_MESSAGES times."""
    import torch

    tensor = torch.zeros(LARGE_FRAME_BYTES // 4)
    metas = [ChunkMeta(view.chunks[0][0].id, "float32", tuple(tensor.shape), 0)] * LARGE_FRAMES
    return [
        _frames(view, body, view.ghost_workers[0], i + 1, metas, [tensor] * LARGE_FRAMES) for i in range(LARGE_MESSAGES)
    ]


def _65536_empty_chunk_entries(view: JobView) -> list[list[bytes]]:
    import torch

    metas = [ChunkMeta(i, "float32", (0,), 0) for i in range(MAX_CHUNKS)]
    return [_frames(view, Push(samples=1), view.ghost_workers[0], 1, metas, [torch.empty(0)] * MAX_CHUNKS)]


def _pulls_never_read(view: JobView) -> list[list[bytes]]:
    return [_frames(view, Pull(), "reader", i + 1) for i in range(UNREAD_PULLS)]


SHARD_0 = SCHEDULER + 1
ATTACKS = (
    Attack("push in another worker's name, samples 2**62", SHARD_0, frozenset({"bad_sender"}), _push_as_another_worker),
    Attack(f"{HELLO_FLOOD} HELLOs", SCHEDULER, frozenset({"full", "hello_rate"}), _hello_flood, flood_room),
    Attack(
        "heartbeat of 10**12 samples", SCHEDULER, frozenset({"bad_field"}), _heartbeat_of_1e12_samples, as_ghost=True
    ),
    Attack(
        "eval of version 2**62, accuracy 0.999, as the evaluator",
        SCHEDULER,
        frozenset({"bad_field"}),
        _eval_of_version_2e62,
        as_ghost=True,
    ),
    Attack(
        "eval of version 2**62, accuracy 0.999, in a worker's name",
        SCHEDULER,
        frozenset({"bad_sender"}),
        _eval_in_a_workers_name,
    ),
    Attack("standalone speed of 5e-324", SCHEDULER, frozenset({"bad_field"}), _speed_of_5e_324, as_ghost=True),
    Attack("hello as shard 0 from another endpoint", SCHEDULER, frozenset({"slot_taken"}), _hello_as_shard_0),
    Attack("byes in other members' names", SCHEDULER, frozenset({"bad_sender"}), _byes_in_other_names),
    Attack(
        "messages of many large frames to a shard",
        SHARD_0,
        SIZE_REFUSALS,
        lambda view: _many_large_frames(view, Push(samples=1)),
    ),
    Attack(
        "messages of many large frames to the scheduler",
        SCHEDULER,
        SIZE_REFUSALS,
        lambda view: _many_large_frames(view, WorkerHeartbeat()),
        as_ghost=True,
    ),
    Attack("a push of 65,536 empty chunk entries", SHARD_0, SIZE_REFUSALS, _65536_empty_chunk_entries),
    Attack(f"{UNREAD_PULLS} pulls never read", SHARD_0, frozenset(), _pulls_never_read, reads=False),
)
