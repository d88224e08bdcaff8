"""The /metrics server of every process is bounded: idle connections cannot pile up threads."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry

from dynabatch.common.metrics import IDLE_TIMEOUT_S, MAX_CONNECTIONS, Health, MetricsServer
from harness import wait_for


def test_idle_connections_are_capped_and_closed_and_metrics_answer_again():
    server = MetricsServer(CollectorRegistry(), Health(), "127.0.0.1", 0)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5 * MAX_CONNECTIONS)]
    refused: set[int] = set()

    def past_the_cap_refused() -> bool:
        readable, _, _ = select.select([s for i, s in enumerate(idle) if i not in refused], [], [], 0.1)
        refused.update(idle.index(s) for s in readable if s.recv(1) == b"")
        return len(refused) >= len(idle) - MAX_CONNECTIONS

    try:
        wait_for("the connections past the cap to be closed on arrival", past_the_cap_refused, 10)
        assert threading.active_count() <= before + MAX_CONNECTIONS
        started = time.monotonic()
        for i, sock in enumerate(idle):
            if i not in refused:
                sock.settimeout(IDLE_TIMEOUT_S * 3)
                assert sock.recv(1) == b"", "an idle connection that was served is closed by the server"
        assert time.monotonic() - started < IDLE_TIMEOUT_S * 3
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as reply:
            assert reply.status == 200
        wait_for("the connection threads to end", lambda: threading.active_count() <= before, 10)
    finally:
        for sock in idle:
            sock.close()
        server.close()


class _HeldCollector:
    """A collector whose scrape waits until the test lets it go: the client can hang up mid-request."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.collected = threading.Event()

    def collect(self):  # prometheus_client's collector protocol
        self.release.wait(10)
        self.collected.set()
        return iter(())


def test_a_scraper_that_hangs_up_before_its_answer_leaves_no_traceback(capsys):
    """Prometheus closes a scrape past its timeout (a slow link): the server neither logs a traceback nor stops."""
    registry = CollectorRegistry()
    held = _HeldCollector()
    registry.register(held)
    server = MetricsServer(registry, Health(), "127.0.0.1", 0)
    before = threading.active_count()
    try:
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        client.close()
        held.release.set()
        wait_for("the scrape to be answered into the closed connection", held.collected.is_set, 10)
        wait_for("its connection's thread to end", lambda: threading.active_count() <= before, 10)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as reply:
            assert reply.status == 200
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Broken pipe" not in err, err
    finally:
        server.close()
