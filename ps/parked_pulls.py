"""Pulls a shard cannot answer in full yet, parked until their chunks are due.

A pull waits for chunks to reach its `min_version` (a synchronous round), or for
its worker to be let through (ssp: too far ahead of the slowest; rennala: the
round has its samples on their way). Each chunk is sent the moment it is due, so
the front of the model is not held up by the back. A pull past its deadline gets
the chunks as they are rather than waiting forever, and so does every parked
pull after a rollback (the versions it waited for are gone). One connection may
park at most `MAX_PARKED_PER_PEER` pulls (peer_limits.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.peer_limits import MAX_PARKED_PER_PEER
from dynabatch.ps.serve_order import rank_of
from dynabatch.ps.shard_state import ShardState

# Send chunks `ids` to a connection as the answer to its request `seq`; the travelling buffers go with the first
# to the worker named (None: not now).
SendChunks = Callable[[bytes, int, list[int], str | None], None]


@dataclass
class ParkedPull:
    """A pull's chunks still to send (`remaining`), what they wait for, and until when."""

    identity: bytes
    seq: int
    worker: str
    remaining: list[int]
    min_version: int
    deadline: float
    buffers: bool = False  # the travelling buffers are still to be sent, with the next chunk


@dataclass
class ParkedPulls:
    """The parked pulls, oldest first."""

    waiting: list[ParkedPull] = field(default_factory=list)

    def check_room(self, identity: bytes) -> None:
        """Refuse (`busy`) a pull that would park while its connection already has its fill of parked pulls."""
        if sum(p.identity == identity for p in self.waiting) >= MAX_PARKED_PER_PEER:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"{MAX_PARKED_PER_PEER} pulls from this connection already wait; "
                "read their answers before asking again",
            )

    def park(self, pull: ParkedPull) -> None:
        self.waiting.append(pull)

    def serve(self, model: ShardState, send: SendChunks, ranks: Mapping[str, int]) -> None:
        """Send waiting pulls the chunks that are now due: at their version, and their worker let through; the
        workers the scheduler ranks first are sent theirs first (ps/serve_order.py), oldest first within a rank."""
        for p in sorted(self.waiting, key=lambda p: rank_of(p.worker, ranks)):
            if not model.admit_pull(p.worker):
                continue
            due = [cid for cid in p.remaining if model.due(cid, p.worker, p.min_version)]
            if due:
                send(p.identity, p.seq, due, p.worker if p.buffers else None)
                p.buffers = False
                p.remaining = [cid for cid in p.remaining if cid not in due]
        self.waiting = [p for p in self.waiting if p.remaining]

    def expire(self, now: float, send: SendChunks, ranks: Mapping[str, int]) -> None:
        """Send a parked pull past its deadline (every one, with `now` inf) the current chunks, in rank order."""
        expired = [p for p in self.waiting if p.deadline <= now]
        if expired:
            self.waiting = [p for p in self.waiting if p.deadline > now]
            for p in sorted(expired, key=lambda p: rank_of(p.worker, ranks)):
                send(p.identity, p.seq, p.remaining, p.worker if p.buffers else None)
