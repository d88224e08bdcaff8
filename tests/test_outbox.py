"""ps/outbox.py on a real ROUTER and DEALER over TCP: replies to a peer that does not read are held up to
a bound, then dropped and counted; once it reads, the held ones arrive, in order, none twice."""

from __future__ import annotations

import time

import zmq

from dynabatch.common.net.transport import bind_router
from dynabatch.ps.outbox import IDLE_POLL_MS, SEND_QUEUE, Outbox

FRAME = b"x" * (256 << 10)
SENT = 200  # 50 MB: more than the kernel's socket buffers hold
LIMIT = 20


def test_replies_wait_for_a_peer_that_does_not_read_up_to_a_bound_then_arrive_in_order() -> None:
    ctx = zmq.Context()
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", send_queue=SEND_QUEUE)
    reader = ctx.socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 4096)
    reader.connect(endpoint)
    dropped = []
    try:
        reader.send(b"hello")
        identity = router.recv_multipart()[0]
        outbox = Outbox(router, LIMIT, lambda: dropped.append(1))
        for i in range(SENT):
            outbox.send(identity, [i.to_bytes(4, "big"), FRAME])
        assert outbox.full(identity) and outbox.backlog
        assert dropped, "every reply was held though the peer read none"
        deadline = time.monotonic() + 10
        while outbox.poll_ms < IDLE_POLL_MS and time.monotonic() < deadline:  # the kernel's buffers fill, then stall
            outbox.flush()
            router.poll(outbox.poll_ms)  # as the shard's loop waits between flushes
        assert outbox.poll_ms == IDLE_POLL_MS, "a peer that reads nothing must not keep the loop spinning"
        received: list[int] = []
        deadline = time.monotonic() + 60
        while len(received) + len(dropped) < SENT and time.monotonic() < deadline:
            outbox.flush()
            if reader.poll(100):
                received.append(int.from_bytes(reader.recv_multipart()[0], "big"))
        outbox.flush()
        assert outbox.poll_ms == IDLE_POLL_MS
        assert len(received) + len(dropped) == SENT, (len(received), len(dropped))
        assert received == sorted(set(received)), "replies arrived out of order or twice"
        assert received[:SEND_QUEUE] == list(range(SEND_QUEUE))
        assert not outbox.backlog
    finally:
        reader.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_replies_to_a_peer_that_left_are_discarded_not_kept() -> None:
    ctx = zmq.Context()
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", send_queue=SEND_QUEUE)
    try:
        outbox = Outbox(router, LIMIT, lambda: None)
        outbox.send(b"\x00gone", [b"reply"])
        assert not outbox.backlog
    finally:
        router.close(linger=0)
        ctx.term()
