"""Each PUSH is taken once: a per-connection sequence window, kept across shard restarts.

A worker's connection to a shard numbers every request it sends (the envelope's
`seq`, common/net/transport.py's Connection), and ZeroMQ keeps their order on one
connection; a retry (after `shard_lost`, or after a refusal) is a new request with
a new, higher seq. So a PUSH whose seq this shard has already taken from the same
sender on the same connection, or one older than anything it remembers, is a
replay: refused `replay`, and nothing changes.

The shard handles the messages of one poll in priority order (front of the model
first), not in arrival order, so a connection's seqs may be taken slightly out of
order: every seq within `WINDOW` of the highest taken is remembered one by one, as
IPsec's anti-replay window does. The window is keyed by (sender, connection): a
worker process that registers again, or a recycled worker id after a scheduler
restart, speaks from a new connection (a fresh random routing id) whose seqs start
at 1 again.

Across a shard restart the high-water marks come back from the checkpoint
(`saved`/`restore`): the restored model holds exactly the pushes taken up to the
checkpoint, and anything at or below a saved mark is refused. A push taken after
the checkpoint was lost with the model that held it, so it may be taken once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError

WINDOW = 1024  # seqs below the highest that are still told apart: more than one poll's batch of messages (64)
MAX_KEYS = 4096  # connections remembered; beyond it those of workers no longer live are forgotten, oldest first


@dataclass
class _Seen:
    high: int = 0
    floor: int = 0  # every seq at or below it is refused (a checkpoint's mark: what came before is not known)
    recent: set[int] = field(default_factory=set)  # taken seqs in (max(floor, high - WINDOW), high]


@dataclass
class ReplayGuard:
    """(sender, connection) -> the seqs of its PUSHes already taken."""

    seen: dict[tuple[str, bytes], _Seen] = field(default_factory=dict)

    def check(self, sender: str, identity: bytes, seq: int) -> None:
        """Refuse (`replay`) a PUSH whose seq was taken already, or is too old to tell; changes nothing."""
        mark = self.seen.get((sender, identity))
        if mark is None or seq > mark.high:
            return
        if seq <= max(mark.floor, mark.high - WINDOW) or seq in mark.recent:
            raise ProtocolError(
                ErrorCode.REPLAY,
                f"PUSH seq {seq} from {sender!r} on this connection was taken already "
                f"(or is older than what this shard remembers, {mark.high}); a retry is a new request",
            )

    def take(self, sender: str, identity: bytes, seq: int, live: set[str]) -> None:
        """Remember that the PUSH `seq` was taken (after `check`, once the push is applied or queued)."""
        key = (sender, identity)
        mark = self.seen.pop(key, None) or _Seen()
        self.seen[key] = mark  # most recently used last
        if seq > mark.high:
            mark.high = seq
            mark.recent = {s for s in mark.recent if s > seq - WINDOW}
        mark.recent.add(seq)
        if len(self.seen) > MAX_KEYS:
            self._forget(live)

    def _forget(self, live: set[str]) -> None:
        for old in [k for k in self.seen if k[0] not in live][: len(self.seen) - MAX_KEYS]:
            del self.seen[old]

    def saved(self) -> dict[str, dict[str, int]]:
        """The high-water marks as plain data for a checkpoint: {sender: {routing id (hex): seq}}."""
        out: dict[str, dict[str, int]] = {}
        for (sender, identity), mark in self.seen.items():
            out.setdefault(sender, {})[identity.hex()] = mark.high
        return out

    def restore(self, saved: dict[str, dict[str, int]]) -> None:
        """Marks from a checkpoint: every seq at or below them is refused."""
        self.seen = {
            (sender, bytes.fromhex(ident)): _Seen(int(high), int(high))
            for sender, marks in saved.items()
            for ident, high in marks.items()
        }
