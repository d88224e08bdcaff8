"""A tiny HTTP/1.0 server that idle, slow or numerous clients cannot starve: one thread, bounded everything.

Kubernetes' liveness probe restarts a process whose /healthz does not answer in
time, so that answer must not wait behind anyone. A thread per connection (with
a cap on threads) is starved by a few hundred connections that send nothing, or
by a slowloris that sends one byte a second and so never trips a per-read timeout.

Here one thread runs a selector over every connection. A connection has
`REQUEST_TIMEOUT_S` in all, from its accept, to send its request line and headers
(at most `MAX_REQUEST_BYTES`), and `REPLY_TIMEOUT_S` to read the answer; past that
it is closed. At most `MAX_OPEN` connections are held: a new one past that closes
the oldest one that is still sending its request, so a flood of idle connections
costs a bounded number of descriptors and never locks out the next client, whose
request (a probe sends it at once) is answered on the loop's next turn. Every
answer closes its connection (`Connection: close`), and the answers are computed
in this thread: /metrics and /healthz take milliseconds.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

MAX_OPEN = 256  # connections held at once
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 2.0  # from accept to the end of the request's headers, however it trickles in
REPLY_TIMEOUT_S = 5.0  # to take the whole answer
TURN_S = 0.1  # how often deadlines are checked when nothing happens
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}

Respond = Callable[[str], tuple[int, bytes, str]]  # path -> (status, body, content type)
log = logging.getLogger("dynabatch.http")


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    reply: memoryview | None = None  # set once the request is in: what is left to send


class SelectorHTTPServer:
    """Serves GET requests from `respond` on (host, port) from a thread of its own until `close`."""

    def __init__(self, host: str, port: int, respond: Respond) -> None:
        self.respond = respond
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the oldest first
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="metrics", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception:  # a bug must cost one connection at most, never the endpoint
                log.exception("metrics server: internal error")

    def _turn(self) -> None:
        for key, events in self._selector.select(TURN_S):
            if key.fileobj is self._listener:
                self._accept()
                continue
            conn = self._conns.get(cast(socket.socket, key.fileobj))  # registered by _accept
            if conn is None:
                continue
            if events & selectors.EVENT_READ and conn.reply is None:
                self._read(conn)
            elif events & selectors.EVENT_WRITE and conn.reply is not None:
                self._write(conn)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the client gave up already: try again next turn
                return
            if len(self._conns) >= MAX_OPEN:
                self._evict()
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic() + REQUEST_TIMEOUT_S)
            self._selector.register(sock, selectors.EVENT_READ)

    def _evict(self) -> None:
        """Close the oldest connection still sending its request (or, if every one is being answered, the oldest)."""
        waiting = next((c for c in self._conns.values() if c.reply is None), None)
        self._drop(waiting or next(iter(self._conns.values())))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_REQUEST_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        conn.received += data
        if b"\r\n\r\n" in conn.received or b"\n\n" in conn.received:
            self._answer(conn, *self._route(bytes(conn.received)))
        elif len(conn.received) > MAX_REQUEST_BYTES:
            self._answer(conn, 431, b"request too large\n", "text/plain; charset=utf-8")

    def _route(self, request: bytes) -> tuple[int, bytes, str]:
        parts = request.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n", "text/plain; charset=utf-8"
        if parts[0] not in (b"GET", b"HEAD"):
            return 405, b"only GET\n", "text/plain; charset=utf-8"
        return self.respond(parts[1].decode("latin-1").split("?", 1)[0])

    def _answer(self, conn: _Conn, status: int, body: bytes, ctype: str) -> None:
        head = (
            f"HTTP/1.0 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        conn.reply = memoryview(head + body)
        conn.deadline = time.monotonic() + REPLY_TIMEOUT_S
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        if conn.reply is None:  # the request is not in yet
            return
        try:
            sent = conn.sock.send(conn.reply)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(conn)
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
