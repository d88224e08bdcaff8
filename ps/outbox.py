"""Replies wait here, in order, for a peer whose ZeroMQ queue is full.

The shard's ROUTER has a small fixed send high-water mark (`SEND_QUEUE`), set
before it binds, and ROUTER_MANDATORY, so a send to a full queue raises instead
of vanishing. ZeroMQ copies a socket's options into each connection it accepts,
so only options set before bind reach them all; setting the mark again after
bind (to size it to the model) crashed libzmq's IO thread when it raced with a
closing connection. So the mark stays small and fixed, and what does not fit
waits here per peer, flushed as the peer reads.

An honest worker reads everything it asks for, so its replies only pass through
here during a burst (a pull of many chunks). A peer that does not read fills
its queue, then its backlog up to `limit` messages; the shard refuses its next
pull `busy` (`full`), and anything more for it is dropped and counted, so unread
replies never pin more than `SEND_QUEUE + limit` messages of the model per peer.
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Callable

import zmq

SEND_QUEUE = 16  # messages ZeroMQ holds per peer (the ROUTER's SNDHWM)
IDLE_POLL_MS = 50  # the shard loop's poll when nothing waits here
SPIN_FLUSHES = 16  # flushes 1 ms apart that may send nothing before the loop backs off (ZeroMQ draining a burst)


class Outbox:
    """A ROUTER's sends, with a bounded per-peer backlog behind ZeroMQ's queue."""

    def __init__(self, sock: zmq.Socket, limit: int, on_drop: Callable[[], None]) -> None:
        """`sock` is bound with SNDHWM `SEND_QUEUE` and ROUTER_MANDATORY; `on_drop` counts each dropped reply."""
        self.sock = sock
        self.limit = limit
        self.on_drop = on_drop
        self.backlog: dict[bytes, deque[list]] = {}
        self._stalled = 0  # flushes in a row that sent nothing

    def send(self, identity: bytes, frames: list) -> None:
        """Send `frames` (after the routing id) to `identity` now, or after what already waits for it."""
        waiting = self.backlog.get(identity)
        if waiting is not None:
            if len(waiting) >= self.limit:
                self.on_drop()
            else:
                waiting.append(frames)
            return
        if not self._try(identity, frames):
            self.backlog[identity] = deque([frames])

    def flush(self) -> None:
        """Send what waits, peer by peer, until each peer's queue is full again."""
        sent = False
        for identity in list(self.backlog):
            waiting = self.backlog[identity]
            while waiting and self._try(identity, waiting[0]):
                waiting.popleft()
                sent = True
            if not waiting:
                del self.backlog[identity]
        self._stalled = 0 if sent else self._stalled + 1

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

    def _try(self, identity: bytes, frames: list) -> bool:
        """Send if `identity`'s queue has room; True also when the peer is gone (the reply has nowhere to go)."""
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
        return True
