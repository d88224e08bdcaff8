"""Replies wait here, in order, for a peer whose ZeroMQ queue is full.

The shard's ROUTER has a small fixed send high-water mark (`SEND_QUEUE`), set
before it binds, and ROUTER_MANDATORY, so a send to a full queue raises instead
of vanishing. ZeroMQ copies a socket's options into each connection it accepts,
so only options set before bind reach them all, and setting the mark again after
bind (to size it to the model) can crash libzmq's IO thread when it races with a
closing connection. So the mark stays small and fixed, and what does not fit waits
here per peer, flushed as the peer reads.

An honest worker reads everything it asks for, so its replies only pass through
here during a burst (a pull of many chunks). A peer that does not read fills
its queue, then its backlog up to `limit` messages; the shard refuses its next
pull `busy` (`full`), and anything more for it is dropped and counted, so unread
replies never pin more than `SEND_QUEUE + limit` messages of the model per peer.

The shard's egress is one link that ZeroMQ's IO thread shares among every peer
whose queue holds something, so serving a ranked worker's pull first
(serve_order.py) would order only the shard's handling, not its bytes on the
wire. With the scheduler's ranks (`ranks`, by connection; `--chunk-schedule
scheduled`, in a protocol with rounds, where the first rank is the worker the
round waits for and the others would wait for it anyway; an asynchronous job
keeps the egress shared, since holding a fast worker behind one whose own slow
link bounds its transfer would only idle the shard's link) the egress goes to
the best-ranked peer that is sending: while a peer
ranked above has replies in flight (its ZeroMQ queue full and replies waiting
here behind it), a lower-ranked peer's replies wait here instead of joining the
wire, and `flush` serves peers in rank order. A peer whose waiting replies have
not moved for `STALL_S` is not reading, and holds nobody back. The ranks come
only from the scheduler's answer to the shard; nothing a worker sends sets them.
Without ranks (`fixed`) replies go as they always did.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from collections.abc import Callable, Mapping

import zmq

SEND_QUEUE = 16  # messages ZeroMQ holds per peer (the ROUTER's SNDHWM)
IDLE_POLL_MS = 50  # the shard loop's poll when nothing waits here
SPIN_FLUSHES = 16  # flushes 1 ms apart that may send nothing before the loop backs off (ZeroMQ draining a burst)
STALL_S = 1.0  # a backlog that has not moved for this long is not in flight (a 1 MiB chunk crosses 10 Mbit in 0.84 s)


class Outbox:
    """A ROUTER's sends, with a bounded per-peer backlog behind ZeroMQ's queue."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        limit: int,
        on_drop: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sock` is bound with SNDHWM `SEND_QUEUE` and ROUTER_MANDATORY; `on_drop` counts each dropped reply."""
        self.sock = sock
        self.limit = limit
        self.on_drop = on_drop
        self.clock = clock
        self.backlog: dict[bytes, deque[list[bytes | memoryview]]] = {}
        self.ranks: Mapping[bytes, int] = {}  # connection -> the scheduler's serving rank of its worker (0 first)
        self._unranked = 0  # the rank of a connection the scheduler ranked no worker for: after every ranked one
        self._full: set[bytes] = set()  # peers whose ZeroMQ queue was full at the last send tried
        self._moved: dict[bytes, float] = {}  # when each full peer's queue last filled (its replies last moved)
        self._stalled = 0  # flushes in a row that sent nothing

    def send(self, identity: bytes, frames: list[bytes | memoryview]) -> None:
        """Send `frames` (after the routing id) to `identity` now, or after what already waits for it."""
        waiting = self.backlog.get(identity)
        if waiting is not None:
            if len(waiting) >= self.limit:
                self.on_drop()
            else:
                waiting.append(frames)
            return
        if self._held(identity) or not self._try(identity, frames):
            self.backlog[identity] = deque([frames])

    def flush(self) -> None:
        """Send what waits, peer by peer in rank order, until each peer's queue is full again or a peer ranked
        above it is sending."""
        sent = False
        for identity in sorted(self.backlog, key=self.rank):  # a stable sort: without ranks, the order of arrival
            if self._held(identity):
                continue
            waiting = self.backlog[identity]
            while waiting and self._try(identity, waiting[0]):
                waiting.popleft()
                sent = True
            if not waiting:
                del self.backlog[identity]
        self._stalled = 0 if sent else self._stalled + 1

    def rank(self, identity: bytes) -> int:
        """`identity`'s serving rank; past every ranked peer if it has none (an evaluator, a worker not ranked)."""
        return self.ranks.get(identity, self._unranked)

    def rank_by(self, ranks: Mapping[bytes, int]) -> None:
        """Give the egress by `ranks` (connection -> rank, 0 first) from now on; none: in the order replies come."""
        self.ranks = dict(ranks)
        self._unranked = max(self.ranks.values(), default=-1) + 1

    def _held(self, identity: bytes) -> bool:
        """Whether a peer ranked above `identity` has replies in flight, so that `identity`'s must wait."""
        if not self.ranks:
            return False
        mine, now = self.rank(identity), self.clock()
        return any(
            self.rank(peer) < mine and peer in self._full and now - self._moved.get(peer, now) < STALL_S
            for peer in self.backlog
        )

    def full(self, identity: bytes) -> bool:
        """Whether `identity`'s backlog is at its limit (the peer is not reading)."""
        return len(self.backlog.get(identity, ())) >= self.limit

    @property
    def poll_ms(self) -> int:
        """How long the loop may wait before the next flush: 1 ms while replies move or may soon (a large pull
        on its way out, ZeroMQ's IO thread draining its queue), then doubling with every flush that sent
        nothing, so a peer that never reads costs a few wake-ups a second, not a thousand."""
        if not self.backlog:
            return IDLE_POLL_MS
        return min(IDLE_POLL_MS, 1 << min(max(0, self._stalled - SPIN_FLUSHES), 6))

    def _try(self, identity: bytes, frames: list[bytes | memoryview]) -> bool:
        """Send if `identity`'s queue has room; True also when the peer is gone (the reply has nowhere to go)."""
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            if identity not in self._full:
                self._full.add(identity)
                self._moved[identity] = self.clock()  # its queue filled now: it is sending
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
        self._full.discard(identity)
        self._moved.pop(identity, None)
        return True
