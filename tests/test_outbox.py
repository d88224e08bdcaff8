"""ps/outbox.py on a real ROUTER and DEALERs over TCP: replies to a peer that does not read are held up to
a bound, then dropped and counted; once it reads, the held ones arrive, in order, none twice; with ranks, the
higher-ranked peer's replies have the egress to themselves while it reads, and a stalled one holds nobody."""

from __future__ import annotations

import time

import zmq

from dynabatch.common.net.transport import bind_router
from dynabatch.ps.outbox import IDLE_POLL_MS, SEND_QUEUE, STALL_S, Outbox

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


def _peer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, router: zmq.Socket[bytes], name: bytes
) -> tuple[zmq.Socket[bytes], bytes]:
    """A DEALER that reads only when told to (tiny receive buffers), and the routing id the ROUTER knows it by."""
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.connect(endpoint)
    peer.send(name)
    identity, said = router.recv_multipart()
    assert said == name
    return peer, identity


def _fill(outbox: Outbox, identity: bytes) -> int:
    """Replies to `identity` until its ZeroMQ queue is full and one waits in the outbox; returns how many."""
    sent = 0
    while identity not in outbox.backlog:
        assert sent < SENT, "ZeroMQ took 50 MB for a peer that reads nothing"
        outbox.send(identity, [sent.to_bytes(4, "big"), FRAME])
        sent += 1
    return sent


def _read_all(outbox: Outbox, peer: zmq.Socket[bytes], count: int) -> None:
    """`peer` reads `count` replies while the shard's loop flushes."""
    got = 0
    deadline = time.monotonic() + 60
    while got < count and time.monotonic() < deadline:
        outbox.flush()
        if peer.poll(100):
            peer.recv_multipart()
            got += 1
    assert got == count


def test_the_egress_goes_to_the_higher_ranked_peer_and_a_lower_ranked_peers_replies_wait_for_it() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", send_queue=SEND_QUEUE)
    first, first_id = _peer(ctx, endpoint, router, b"first")
    second, second_id = _peer(ctx, endpoint, router, b"second")
    now = [0.0]
    try:
        outbox = Outbox(router, SENT, lambda: None, clock=lambda: now[0])
        outbox.rank_by({first_id: 0, second_id: 1})
        sent = _fill(outbox, first_id)  # the first-ranked peer is sending: its queue is full, more wait behind it
        outbox.send(second_id, [b"second's reply"])
        outbox.flush()
        assert list(outbox.backlog.get(second_id, ())) == [[b"second's reply"]], "it joined the wire beside the first"
        _read_all(outbox, first, sent)  # once the first has all it asked for, the second's reply leaves
        assert second.poll(10_000) and second.recv_multipart() == [b"second's reply"]
        assert not outbox.backlog

        sent = _fill(outbox, first_id)  # the first stops reading: once its replies stall, nobody waits for it
        outbox.send(second_id, [b"not held forever"])
        outbox.flush()
        assert second_id in outbox.backlog
        now[0] += STALL_S
        outbox.flush()
        assert second.poll(10_000) and second.recv_multipart() == [b"not held forever"]

        outbox.rank_by({})  # `fixed`: no ranks, every reply goes as it comes
        outbox.send(second_id, [b"unranked"])
        assert second_id not in outbox.backlog
        assert second.poll(10_000) and second.recv_multipart() == [b"unranked"]
        _read_all(outbox, first, sent)
    finally:
        first.close(linger=0)
        second.close(linger=0)
        router.close(linger=0)
        ctx.term()
