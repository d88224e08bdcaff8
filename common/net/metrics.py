"""/metrics and /healthz for every process, on its own registry.

Each process owns a CollectorRegistry (not the global default) so that tests
can run several roles in one interpreter and a role exports only its own
series. Health is two questions: `/healthz` (is the main loop turning: used
for liveness) and `/readyz` (has the process joined its job, and does it still
hear its scheduler: readiness).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from dynabatch.common.flags import ConfigError
from dynabatch.common.net.connection_caps import REASONS as CAP_REASONS
from dynabatch.common.net.connection_watch import ConnectionReports
from dynabatch.common.net.curve import REFUSALS
from dynabatch.common.net.http_server import SelectorHTTPServer

# Where a process listens (its sockets, its /metrics): logged at any --log-level (`setup_logging`), since a
# launcher reads it to find the process and a user needs it to reach it.
ADDRESS_LOG = logging.getLogger("dynabatch.address")

STALL_S = 30.0
ON_FINISH = ("exit", "idle")
ANNOUNCEMENT = "serving /metrics at "
_ANNOUNCED = re.compile(re.escape(ANNOUNCEMENT) + r"http://\S+:(\d+)/metrics$", re.M)


class Health:
    """Liveness from main-loop ticks, readiness set once a process has joined and while it hears its scheduler."""

    def __init__(self) -> None:
        self._last_tick = time.monotonic()
        self.ready = False
        self.scheduler_lost = False  # scheduler_contact.py

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


class MetricsServer:
    """/metrics, /healthz, /readyz on a server that idle or slow clients cannot starve (http_server.py).

    Bound to port 0 it takes a free port from the kernel, with no window in which another
    process can take it, and logs the one line `announced_port` reads back: how a launcher
    that started it learns where to scrape.
    """

    def __init__(self, registry: CollectorRegistry, health: Health, host: str, port: int) -> None:
        self.registry = registry
        self.health = health
        try:
            self._httpd = SelectorHTTPServer(host, port, self._respond)
        except OSError as exc:  # the port is taken, the host is not this machine's
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConfigError(f"--metrics-host {host} --metrics-port {port}: {reason}") from None
        self.host = host
        self.port = self._httpd.server_address[1]
        ADDRESS_LOG.info("%s%s", ANNOUNCEMENT, self.url())

    def url(self, host: str | None = None) -> str:
        """The /metrics URL as another process on `host` would reach it."""
        shown = host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
        return f"http://{shown}:{self.port}/metrics"

    @property
    def open_connections(self) -> int:
        """Client connections held now (at most http_server.MAX_OPEN)."""
        return self._httpd.open_connections

    def _respond(self, path: str) -> tuple[int, bytes, str]:
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            return 200, generate_latest(self.registry), CONTENT_TYPE_LATEST
        if path == "/healthz":
            ok = self.health.alive()
            return (200, b"ok\n", text) if ok else (503, b"stalled\n", text)
        if path == "/readyz":
            if self.health.scheduler_lost:
                return 503, b"scheduler lost\n", text
            ok = self.health.ready
            return (200, b"ready\n", text) if ok else (503, b"not registered\n", text)
        return 404, b"not found\n", text

    def close(self) -> None:
        self._httpd.close()


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


def handshake_failures(registry: CollectorRegistry) -> Callable[[str], None]:
    """The client side of `auth_failures_counter`: this process's handshakes with its scheduler that failed, by
    curve.REFUSALS reason (a server that refuses a key says nothing: the handshake's failure is all a client sees)."""
    counter = Counter(
        "dynabatch_scheduler_handshake_failures",
        "Handshakes with the scheduler that failed (CURVE keys that do not match its, or CURVE on one side only), "
        "by reason as dynabatch_auth_failures_total's.",
        ["reason"],
        registry=registry,
    )
    for reason in REFUSALS.values():
        counter.labels(reason)
    return lambda reason: counter.labels(reason).inc()


def connection_reports(registry: CollectorRegistry, role: str) -> ConnectionReports:
    """What a server socket's watch reports (connection_watch.py), as series every server role exports: peers
    refused by CURVE, connections shut down over a cap (connection_caps.py) and connections held."""
    auth = auth_failures_counter(registry, role)
    capped = Counter(
        "dynabatch_connections_refused",
        "Connections shut down on arrival over a cap (total: the socket's connections, kept below the process's "
        "descriptor limit; source: one source address's).",
        ["role", "reason"],
        registry=registry,
    )
    for reason in CAP_REASONS:
        capped.labels(role, reason)
    held = Gauge("dynabatch_connections", "Connections the server socket holds now.", ["role"], registry=registry)
    held.labels(role).set(0)
    return ConnectionReports(
        capped=lambda reason: capped.labels(role, reason).inc(),
        refused=lambda reason: auth.labels(role, reason).inc(),
        held=held.labels(role).set,
    )
