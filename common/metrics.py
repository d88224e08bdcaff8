"""/metrics and /healthz for every process, on its own registry.

Each process owns a CollectorRegistry (not the global default) so that tests
can run several roles in one interpreter and a role exports only its own
series. Health is two questions: `/healthz` (is the main loop turning: used
for liveness) and `/readyz` (has the process joined its job: readiness).
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from dynabatch.common.curve import REFUSALS
from dynabatch.common.flags import ConfigError

# Where a process listens (its sockets, its /metrics): logged at any --log-level (`setup_logging`), since a
# launcher reads it to find the process and a user needs it to reach it.
ADDRESS_LOG = logging.getLogger("dynabatch.address")

STALL_S = 30.0
ON_FINISH = ("exit", "idle")
ANNOUNCEMENT = "serving /metrics at "
_ANNOUNCED = re.compile(re.escape(ANNOUNCEMENT) + r"http://\S+:(\d+)/metrics$", re.M)
MAX_CONNECTIONS = 16  # concurrent HTTP connections served; more are closed at once
IDLE_TIMEOUT_S = 5.0  # a connection that sends nothing for this long is closed


class Health:
    """Liveness from main-loop ticks, readiness set once a process has joined."""

    def __init__(self) -> None:
        self._last_tick = time.monotonic()
        self.ready = False

    def tick(self) -> None:
        self._last_tick = time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() - self._last_tick < STALL_S

    def idle_until(self, should_stop: Callable[[], bool], every_s: float = 1.0) -> None:
        """Stay alive on /healthz, doing nothing, until `should_stop()` (a signal handler sets it).

        `--on-finish idle`: in Kubernetes a ps or worker process that exits at the end
        of the job is restarted by its StatefulSet or Deployment, over and over; one
        that idles keeps its pod Running with its final numbers on /metrics until the
        pool is scaled down or deleted. A signal ends the sleep early or within `every_s`.
        """
        while not should_stop():
            self.tick()
            time.sleep(every_s)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most MAX_CONNECTIONS of them: the connections past that are
    closed on arrival, so idle or slow clients cannot pile up threads in a training process."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up before its answer was written (a scraper past its scrape timeout on a slow
        link) is no error of ours: only anything else gets socketserver's traceback in the log."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class MetricsServer:
    """A small threaded HTTP server: /metrics, /healthz, /readyz; bounded in threads and idle time.

    Bound to port 0 it takes a free port from the kernel, with no window in which another
    process can take it, and logs the one line `announced_port` reads back: how a launcher
    that started it learns where to scrape.
    """

    def __init__(self, registry: CollectorRegistry, health: Health, host: str, port: int) -> None:
        self.registry = registry
        self.health = health
        handler = self._handler()
        try:
            self._httpd = BoundedHTTPServer((host, port), handler)
        except OSError as exc:  # the port is taken, the host is not this machine's
            raise ConfigError(f"--metrics-host {host} --metrics-port {port}: {exc.strerror}") from None
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        ADDRESS_LOG.info("%s%s", ANNOUNCEMENT, self.url())

    def url(self, host: str | None = None) -> str:
        """The /metrics URL as another process on `host` would reach it."""
        shown = host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
        return f"http://{shown}:{self.port}/metrics"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = server.health.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"stalled\n")
                elif path == "/readyz":
                    ok = server.health.ready
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not registered\n")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        return Handler

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def announced_port(log_text: str) -> int | None:
    """The port of the last /metrics server announced in a process's log (None before it bound)."""
    found = _ANNOUNCED.findall(log_text)
    return int(found[-1]) if found else None


def bad_messages_counter(registry: CollectorRegistry) -> Counter:
    """Rejected messages by reason code; every role exports it under the same name."""
    return Counter(
        "dynabatch_bad_messages",
        "Received messages rejected (ERROR answered or dropped), by reason.",
        ["role", "reason"],
        registry=registry,
    )



def auth_failures_counter(registry: CollectorRegistry, role: str) -> Counter:
    """Peers refused by CURVE on a server socket; every reason starts at 0 so a dashboard sees the series."""
    counter = Counter(
        "dynabatch_auth_failures",
        "Peers refused in the CURVE handshake (auth: client key not admitted; protocol: no CURVE or wrong server key; "
        "other: the peer hung up mid-handshake).",
        ["role", "reason"],
        registry=registry,
    )
    for reason in REFUSALS.values():
        counter.labels(role, reason)
    return counter
