"""A server socket's connections watched on a thread of their own: over a cap they are shut down; failed
handshakes are reported.

ZeroMQ has no cap on the connections a socket accepts, but its monitor reports
each accepted connection with its descriptor. The watch reads the peer's address
from a duplicate of that descriptor and counts it (connection_caps.py); one over
a cap is shut down through the duplicate, so ZeroMQ reads end-of-file, drops the
connection and closes its own descriptor, which nothing else ever touches. One
monitor serves both concerns, as ZeroMQ gives a socket only one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dynabatch.common.net.connection_caps import ConnectionCaps, ConnectionTally
from dynabatch.common.net.curve import REFUSALS
from dynabatch.common.net.log_limit import RateLimitedLog

log = logging.getLogger("dynabatch.connections")


def _ignore(_: object) -> None:
    pass


@dataclass
class ConnectionReports:
    """Where a socket's watch reports, from its own thread: a connection shut down over a cap (by cap), a failed
    handshake (by curve.REFUSALS reason), and the number of connections held after each change."""

    capped: Callable[[str], None] = _ignore
    refused: Callable[[str], None] = _ignore
    held: Callable[[int], None] = _ignore


def watch_connections(
    sock: zmq.Socket[bytes],
    caps: ConnectionCaps,
    reports: ConnectionReports,
    handshakes: bool = False,
) -> ConnectionWatch:
    """Hold `sock`'s accepted connections within `caps`, and report to `reports`; failed handshakes too with
    `handshakes` (a socket with CURVE). Its thread ends when `sock` closes.

    Handshake failures are seen here rather than in CURVE's ZAP handler, which is consulted only after a
    client has proven it knows the server's public key: a client without CURVE or with the wrong server key
    (the usual misconfigured or foreign peer) fails before ZAP and would never be counted there.
    """
    events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
    if handshakes:
        for event in REFUSALS:
            events |= event
    endpoint = f"inproc://connection-watch-{id(sock)}"
    sock.monitor(endpoint, events)
    monitor = sock.context.socket(zmq.PAIR)
    # No event may be dropped, which ZeroMQ does at a full queue: a lost DISCONNECTED would hold a place under
    # the caps forever. A flood queues at most two small events per connection it opens.
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(endpoint)
    watch = ConnectionWatch(ConnectionTally(caps), reports)
    watch.thread = threading.Thread(target=watch.run, args=(monitor,), name="connection-watch", daemon=True)
    watch.thread.start()
    return watch


class ConnectionWatch:
    """What the watch thread does with each monitor event; `tally` holds the connections it admitted."""

    def __init__(self, tally: ConnectionTally, reports: ConnectionReports) -> None:
        self.tally = tally
        self.reports = reports
        self.refusals = RateLimitedLog(log, what="connection")
        self.thread: threading.Thread | None = None  # set by `watch_connections`, which starts it
        self.failed = False  # an event has raised: the first is logged with its traceback, the rest rate-limited

    def run(self, monitor: zmq.Socket[bytes]) -> None:
        """Take monitor events until the socket closes or the context ends, then close the monitor."""
        try:
            while True:
                try:
                    event = recv_monitor_message(monitor)
                except zmq.ZMQError:  # context terminated: the process is ending
                    return
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # the socket closed
                    return
                try:
                    self.handle(event)
                except Exception as exc:  # a bug must cost one event, never the caps of every later connection
                    if self.failed:
                        self.refusals.refused("internal", f"internal error handling monitor event {event}: {exc!r}")
                    else:
                        log.exception("internal error handling monitor event %s", event)
                        self.failed = True
        finally:
            monitor.close(linger=0)

    def handle(self, event: Mapping[str, Any]) -> None:
        """One monitor event: a connection accepted or gone, or a failed handshake."""
        kind, fd = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self.accepted(fd, event["endpoint"])
        elif kind == zmq.EVENT_DISCONNECTED:
            self.tally.release(fd)
            self.reports.held(self.tally.held)
        else:
            self.reports.refused(REFUSALS[kind])

    def accepted(self, fd: int, listener: bytes) -> None:
        """Count connection `fd`, accepted on `listener` (an endpoint), or shut it down over a cap.

        ZeroMQ's descriptor is only ever duplicated here. A connection already gone
        by now is passed: its descriptor closed, or reused for something that is no
        connection to this socket's port (a file, a /metrics client).
        """
        try:
            duplicate = os.dup(fd)
        except OSError:
            return
        try:
            peer = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            return
        with peer:
            try:
                address, local = peer.getpeername(), peer.getsockname()
            except OSError:
                return
            if isinstance(local, tuple) and not listener.endswith(b":%d" % local[1]):
                return
            source = address[0] if isinstance(address, tuple) else ""  # ipc:// peers have no address: one source
            reason = self.tally.admit(fd, source)
            if reason is None:
                self.reports.held(self.tally.held)
                return
            try:
                peer.shutdown(socket.SHUT_RDWR)
            except OSError:  # it hung up meanwhile
                pass
        self.reports.capped(reason)
        cap = self.tally.caps.total if reason == "total" else self.tally.caps.per_source
        self.refusals.refused(reason, f"{source or 'a local peer'} over the {reason} cap of {cap} connections; closed")
