"""How many connections a server socket holds, in total and from one source address, and who is turned away.

ZeroMQ accepts every TCP connection that reaches a bound socket and spends a
descriptor (and about 20 KB) on each, with no cap of its own: a flood of
connections that complete ZeroMQ's greeting would take a server to its
descriptor limit, and it would die of "Too many open files" at its next file write.
The caps here keep a server's connections below its descriptor limit by a
reserve its own files (checkpoints, progress, logs), its /metrics server and its
libraries need, and keep one source address from taking all of what is left.
The socket side (a monitor thread that shuts refused connections down) is in
connection_watch.py; this is the bookkeeping, without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.net.http_server import MAX_OPEN

# Descriptors kept out of the connection cap: the /metrics server's connections (MAX_OPEN) and as many again for
# the process's own files, ZeroMQ's internal descriptors (a mailbox per socket, its poller), its client
# connections (a shard's to the scheduler) and torch's. At most half the limit on a process with a small one.
RESERVE = 2 * MAX_OPEN
# One source address may hold at most this many: a node behind NAT holds one connection per worker process
# to each server (four times the default --max-workers); an attacker on one address gets no more.
PER_SOURCE = 1024
REASONS = ("total", "source")  # which cap turned a connection away (the metric's reason label)


@dataclass(frozen=True)
class ConnectionCaps:
    """The most connections a server socket holds at once, in total and from one source address."""

    total: int
    per_source: int

    @classmethod
    def for_descriptor_limit(cls, limit: int) -> ConnectionCaps:
        """The caps of a process that may open `limit` descriptors: all but RESERVE of them (at most half the
        limit), and PER_SOURCE per source address, never more than the total."""
        total = limit - min(RESERVE, limit // 2)
        return cls(total, min(PER_SOURCE, total))


class ConnectionTally:
    """The connections a socket holds, by descriptor and source address; it admits one or says which cap it breaks.

    Keyed by descriptor, as ZeroMQ's monitor events name connections: a
    descriptor admitted again (a release the tally never saw) replaces its old
    entry, and a release of one it does not hold (a refused connection's) is
    ignored, so the counts cannot drift.
    """

    def __init__(self, caps: ConnectionCaps) -> None:
        self.caps = caps
        self._source_of: dict[int, str] = {}
        self._per_source: dict[str, int] = {}

    @property
    def held(self) -> int:
        return len(self._source_of)

    def held_from(self, source: str) -> int:
        return self._per_source.get(source, 0)

    def admit(self, fd: int, source: str) -> str | None:
        """Hold connection `fd` from `source`; or, over a cap, hold nothing and return that cap's reason."""
        self.release(fd)
        if self.held >= self.caps.total:
            return "total"
        if self.held_from(source) >= self.caps.per_source:
            return "source"
        self._source_of[fd] = source
        self._per_source[source] = self.held_from(source) + 1
        return None

    def release(self, fd: int) -> None:
        """Connection `fd` is gone (a release of one not held changes nothing)."""
        source = self._source_of.pop(fd, None)
        if source is None:
            return
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]
