"""What a server socket does against connections that only complete ZeroMQ's greeting: pings, caps, and the
descriptor limit."""

from __future__ import annotations

import resource
import subprocess
import sys

import zmq

from dynabatch.common.net.connection_caps import ConnectionCaps
from dynabatch.common.net.connection_watch import ConnectionReports, watch_connections
from dynabatch.common.net.transport import PEER_PING_IVL_MS, PEER_PING_TIMEOUT_MS, bind_router
from fuzz.greeting_flood import close_flood, open_flood, shut_down_by_server
from hang_guard import hang_guard_s
from harness import wait_for


def test_a_server_socket_pings_its_peers_and_drops_those_that_never_answer() -> None:
    ctx = zmq.Context()
    try:
        sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0")
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == PEER_PING_IVL_MS
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == PEER_PING_TIMEOUT_MS
        sock.close(linger=0)
    finally:
        ctx.term()


def test_a_process_raises_its_descriptor_limit_to_the_hard_limit_before_it_serves() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = (
        f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {hard})); "
        "from dynabatch.common.net.transport import open_context; open_context(None); "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_guard_s(60), check=True
    )
    assert int(out.stdout) == (hard if hard != resource.RLIM_INFINITY else low)
    assert soft <= hard


def test_a_socket_shuts_down_connections_over_its_caps_keeps_serving_its_peers_and_takes_new_ones_later() -> None:
    """A real ROUTER and real TCP connections that complete ZeroMQ's handshake, under caps of a few dozen."""
    caps = ConnectionCaps(total=40, per_source=30)
    ctx = zmq.Context()
    capped: list[str] = []
    held: list[int] = []
    router = ctx.socket(zmq.ROUTER)
    peer = ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        watch = watch_connections(router, caps, ConnectionReports(capped=capped.append, held=held.append))
        peer.connect(f"tcp://127.0.0.1:{port}")
        _round_trip(router, peer)
        # The round trip proves ZeroMQ took the connection; the watch hears of it on its own thread, after.
        wait_for("the watch to count the peer", lambda: watch.tally.held == 1)
        flood = open_flood("127.0.0.1", port, 3 * caps.per_source)
        try:
            wait_for(
                "every flood connection admitted or shut down", lambda: watch.tally.held + len(capped) == 1 + len(flood)
            )
            # The peer holds one of 127.0.0.1's places: every flood connection past the rest is shut down.
            over = len(flood) - (caps.per_source - 1)
            assert watch.tally.held == caps.per_source and capped == ["source"] * over
            wait_for("the refused connections to read end-of-file", lambda: shut_down_by_server(flood) == over)
            _round_trip(router, peer)
        finally:
            close_flood(flood)
        wait_for("the flood's places to be given back", lambda: watch.tally.held == 1)
        again = open_flood("127.0.0.1", port, caps.per_source - 1)
        wait_for("a new flood to take them", lambda: watch.tally.held == caps.per_source)
        close_flood(again)
        wait_for("the new flood's places to be given back", lambda: held[-1] == 1)
        assert len(capped) == over and max(held) == caps.per_source and held[-1] == 1
        _round_trip(router, peer)
    finally:
        peer.close(linger=0)
        router.close(linger=0)
        ctx.term()
    assert watch.thread is not None
    watch.thread.join(timeout=10)
    assert not watch.thread.is_alive(), "the watch ends with its socket"


def _round_trip(router: zmq.Socket[bytes], peer: zmq.Socket[bytes]) -> None:
    peer.send(b"ping")
    assert router.poll(10_000), "the router never got the peer's message"
    identity, body = router.recv_multipart()
    assert body == b"ping"
    router.send_multipart([identity, b"pong"])
    assert peer.poll(10_000) and peer.recv() == b"pong"
