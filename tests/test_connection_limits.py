"""What a server socket does against connections that only complete ZeroMQ's greeting, and the descriptor limit."""

from __future__ import annotations

import resource
import subprocess
import sys

import zmq

from dynabatch.common.transport import PEER_PING_IVL_MS, PEER_PING_TIMEOUT_MS, bind_router


def test_a_server_socket_pings_its_peers_and_drops_those_that_never_answer():
    ctx = zmq.Context()
    try:
        sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0")
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == PEER_PING_IVL_MS
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == PEER_PING_TIMEOUT_MS
        sock.close(linger=0)
    finally:
        ctx.term()


def test_a_process_raises_its_descriptor_limit_to_the_hard_limit_before_it_serves():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {hard})); "
            "from dynabatch.common.transport import open_context; open_context(None); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) == (hard if hard != resource.RLIM_INFINITY else low)
    assert soft <= hard
