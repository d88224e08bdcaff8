"""The /metrics server of every process cannot be starved: probes answer while idle and slowloris clients hold on.

Real sockets on 127.0.0.1 against a real MetricsServer: 500 connections that send
nothing and 24 that trickle their request a byte at a time are opened (bounded in
count, and closed within the test); meanwhile /healthz is probed as Kubernetes
would, each probe with a 1 s timeout, and no probes in a row fail as often as
Kubernetes' failure threshold (its default, 3), which would restart the process:
on a machine loaded by a second copy of the suite, the test's own threads (the
clients and the server share one interpreter) once held a single probe past its
second. Afterwards the server still serves, and it held at most MAX_OPEN
descriptors for its clients.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from dynabatch.common.net.http_server import MAX_OPEN, REQUEST_TIMEOUT_S
from dynabatch.common.net.metrics import Health, MetricsServer
from harness import wait_for

IDLE, SLOW, PROBES = 500, 24, 20
PROBE_TIMEOUT_S = 1.0  # Kubernetes' default timeoutSeconds
FAILURE_THRESHOLD = 3  # Kubernetes' default: probes in a row that fail before it restarts the container


def _probe(port: int, path: str = "/healthz") -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=PROBE_TIMEOUT_S) as reply:
        reply.read()
        code: int = reply.status
    return code


def _probe_in_time(port: int) -> int | None:
    """A probe's status, or None where it took longer than its timeout (as Kubernetes counts a failure)."""
    started = time.monotonic()
    try:
        status = _probe(port)
    except (TimeoutError, urllib.error.URLError):
        return None
    return status if time.monotonic() - started < PROBE_TIMEOUT_S else None


def _slowloris(port: int, stop: threading.Event) -> None:
    """Open a connection and send a request one byte every 0.2 s, reconnecting when the server closes it."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            try:
                for byte in request:
                    if stop.wait(0.2):
                        return
                    sock.send(bytes([byte]))
            except OSError:
                continue


def test_probes_answer_within_their_timeout_while_idle_and_slowloris_connections_are_open() -> None:
    server = MetricsServer(CollectorRegistry(), Health(), "127.0.0.1", 0)
    stop = threading.Event()
    idle: list[socket.socket] = []
    slow = [threading.Thread(target=_slowloris, args=(server.port, stop), daemon=True) for _ in range(SLOW)]
    try:
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        for t in slow:
            t.start()
        answered = []
        for _ in range(PROBES):
            answered.append(_probe_in_time(server.port))
            assert server.open_connections <= MAX_OPEN
        assert set(answered) <= {200, None}, answered
        failed_in_a_row = max(len(run) for run in "".join("x" if a is None else "." for a in answered).split("."))
        assert failed_in_a_row < FAILURE_THRESHOLD, f"Kubernetes would have restarted the process: {answered}"
        assert answered.count(200) >= PROBES - FAILURE_THRESHOLD, answered
    finally:
        stop.set()
        for t in slow:
            t.join(timeout=5)
        for sock in idle:
            sock.close()
    assert _probe(server.port, "/metrics") == 200, "the server stays up afterwards"
    server.close()


def test_a_connection_that_never_finishes_its_request_is_closed_after_the_request_timeout() -> None:
    server = MetricsServer(CollectorRegistry(), Health(), "127.0.0.1", 0)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.send(b"GET /healthz HTTP/1.1\r\n")  # and never the blank line
        sock.settimeout(REQUEST_TIMEOUT_S * 5)
        started = time.monotonic()
        assert sock.recv(1) == b"", "the server closes it"
        assert REQUEST_TIMEOUT_S * 0.5 < time.monotonic() - started < REQUEST_TIMEOUT_S * 5
        sock.close()
        wait_for("the server to hold no connection", lambda: server.open_connections == 0, 10)
        assert _probe(server.port) == 200
    finally:
        server.close()


class _HeldCollector:
    """A collector whose scrape waits until the test lets it go: the client can hang up mid-request."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.collected = threading.Event()

    def collect(self) -> Iterator[Metric]:  # prometheus_client's collector protocol
        self.release.wait(10)
        self.collected.set()
        return iter(())


def test_a_scraper_that_hangs_up_before_its_answer_leaves_no_traceback(capsys: pytest.CaptureFixture[str]) -> None:
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
