"""ZeroMQ sockets for dynabatch: servers bind ROUTER, clients connect DEALER.

Request/reply matching: a reply carries the `seq` of the request it answers, so
a client that timed out and retried can drop a late answer to the old request.
Servers never block on a peer: ROUTER drops what it cannot route, and sends
are non-blocking, so a dead worker cannot stall a shard.

CURVE is a property of the process's context (`open_context`): every socket the
context makes is secured the same way, so a role passes its `--curve-dir` once and
no code that opens a connection has to know about keys.
"""

from __future__ import annotations

import functools
import itertools
import operator
import resource
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from dynabatch.common.flags import ConfigError
from dynabatch.common.net.connection_caps import ConnectionCaps
from dynabatch.common.net.connection_watch import ConnectionReports, watch_connections
from dynabatch.common.net.curve import (
    REFUSALS,
    CurveKeys,
    KeyRole,
    key_role,
    secure_client,
    secure_server,
    start_authenticator,
)
from dynabatch.common.wire.frames import ChunkMeta, Message, ProtocolError, WireLimits, decode, encode
from dynabatch.common.wire.messages import Error

if TYPE_CHECKING:
    import torch

MAX_MESSAGE_BYTES = 1 << 31
# A peer that completed ZeroMQ's greeting and then answers no ZMTP PING for this long is disconnected (libzmq
# answers PINGs by itself, so every live dynabatch process does): a flood of bare greetings does not stay open.
PEER_PING_IVL_MS = 15_000
PEER_PING_TIMEOUT_MS = 60_000


class RemoteError(Exception):
    """The peer answered ERROR."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


@dataclass
class _Curve:
    keys: CurveKeys
    authenticator: ThreadAuthenticator | None = None  # the context's ZAP handler, started with its first server socket


_CURVE: weakref.WeakKeyDictionary[zmq.Context[zmq.Socket[bytes]], _Curve] = weakref.WeakKeyDictionary()


def open_context(curve: CurveKeys | None) -> zmq.Context[zmq.Socket[bytes]]:
    """The process's context; with keys, every socket it makes from now on uses CURVE.

    The process's descriptor limit is raised to its hard limit first: ZeroMQ takes one per accepted
    connection, and a server socket's caps (`bind_router`) leave the process's own files (checkpoints,
    progress) a reserve below that limit.
    """
    raise_descriptor_limit()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if curve is not None:
        use_curve(ctx, curve)
    return ctx


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def descriptor_limit() -> int:
    """The descriptors this process may hold open (its soft limit; 2**20 where it has none)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def use_curve(ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
    """Secure every socket `ctx` makes from now on with `keys` (tests use it on their own contexts)."""
    _CURVE[ctx] = _Curve(keys)


def _configure(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock


def bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    reports: ConnectionReports | None = None,
    send_queue: int | None = None,
) -> tuple[zmq.Socket[bytes], str]:
    """A ROUTER bound to `endpoint` (port 0 or '*' picks a free port); returns the real endpoint.

    It holds at most the connections the process's descriptor limit leaves room for (connection_caps.py),
    and tells `reports` of every connection it shuts down over a cap and how many it holds.
    With CURVE on the context it admits only clients holding a client key of a role it serves;
    `reports.refused(reason)` is called for every peer whose handshake fails. With `send_queue` ZeroMQ
    queues at most that many messages per peer and a send to a full queue raises zmq.Again
    (ROUTER_MANDATORY) rather than dropping the message: set before bind, as ZeroMQ copies the
    options into every connection it accepts (ps/outbox.py).
    """
    sock = _configure(ctx.socket(zmq.ROUTER))
    sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_PING_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_PING_TIMEOUT_MS)
    if send_queue is not None:
        sock.setsockopt(zmq.SNDHWM, send_queue)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    curve = _CURVE.get(ctx)
    if curve is not None:
        if curve.authenticator is None:
            curve.authenticator = start_authenticator(ctx, curve.keys)
        secure_server(sock, curve.keys)
    caps = ConnectionCaps.for_descriptor_limit(descriptor_limit())
    watch_connections(sock, caps, reports or ConnectionReports(), handshakes=curve is not None)
    if endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:  # "Address already in use" (dynabatch run's launcher reads it), a foreign address
        sock.close(linger=0)
        reason = zmq.strerror(exc.errno) if exc.errno is not None else exc.strerror  # strerror names the address
        raise ConfigError(f"--bind {endpoint}: {reason}") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


@dataclass
class Incoming:
    """One message off a ROUTER: who sent it, and the message or why it was rejected.

    `key_role` is the client role of the CURVE key the connection authenticated
    with (None without CURVE); `peer` its remote IP address ("" where the
    transport has none), read from the frame only when asked for (a HELLO).
    """

    identity: bytes
    message: Message[Any] | None
    error: ProtocolError | None
    key_role: KeyRole | None = None
    frame: zmq.Frame | None = None

    @property
    def decoded(self) -> Message[Any]:
        """The message, once its `error` has been dealt with (`recv_routed` gives a message or why there is none,
        never neither)."""
        if self.message is None:
            raise RuntimeError(f"no message to handle: {self.error}")
        return self.message

    @property
    def peer(self) -> str:
        return (_property(self.frame, "Peer-Address") if self.frame is not None else None) or ""


def _property(frame: zmq.Frame, name: str) -> str | None:
    """A ZeroMQ message property (ZAP "User-Id", "Peer-Address"); None where the connection has none."""
    try:
        return str(frame.get(name))
    except zmq.ZMQError:
        return None


def recv_routed(sock: zmq.Socket[bytes], limits: WireLimits | None = None) -> Incoming:
    """Receive and validate one message from a ROUTER without raising on bad input (within `limits`, if given)."""
    frames = sock.recv_multipart(copy=False)
    identity = frames[0].bytes
    role = key_role(_property(frames[0], "User-Id")) if sock.context in _CURVE else None
    try:
        return Incoming(identity, decode(frames[1:], limits), None, role, frames[0])
    except ProtocolError as exc:
        return Incoming(identity, None, exc, role, frames[0])


def recv_waiting(sock: zmq.Socket[bytes], most: int, limits: WireLimits | None = None) -> list[Incoming]:
    """One message from a ROUTER (`recv_routed`), then those already waiting behind it, `most` in all."""
    pending = [recv_routed(sock, limits)]
    while len(pending) < most and sock.poll(0):
        pending.append(recv_routed(sock, limits))
    return pending


def reply_frames(
    body: Any,
    seq: int,
    job: str,
    sender: str,
    chunks: Sequence[ChunkMeta] = (),
    tensors: Sequence[torch.Tensor | memoryview] = (),
) -> list[Any]:
    """A reply's frames, to follow the routing id on a ROUTER (`tensors` may be lent bytes: see `encode`)."""
    return encode(Message(body, list(chunks), [], job, sender, seq), tensors)


def send_routed(
    sock: zmq.Socket[bytes],
    identity: bytes,
    body: Any,
    seq: int,
    job: str,
    sender: str,
    chunks: Sequence[ChunkMeta] = (),
    tensors: Sequence[torch.Tensor | memoryview] = (),
) -> bool:
    """Reply through a ROUTER; False (and nothing sent) if the peer is gone or full."""
    try:
        sock.send_multipart(
            [identity, *reply_frames(body, seq, job, sender, chunks, tensors)], copy=False, flags=zmq.NOBLOCK
        )
    except zmq.Again:
        return False
    return True


def send_error(
    sock: zmq.Socket[bytes],
    incoming: Incoming,
    error: ProtocolError,
    job: str,
    sender: str,
) -> None:
    """Answer a rejected message with ERROR, echoing its seq where it had one."""
    send_routed(sock, incoming.identity, error.to_error(), error.ref, job, sender)


class Connection:
    """A DEALER to one server, with seq numbering and reply matching.

    `request` is a blocking call with a timeout; `send` plus `drain` is the
    fire-and-forget pattern used for heartbeats, where only the latest answer
    matters. `watch_drops` tells a client waiting on several servers at once
    that one of their links dropped.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, job: str, sender: str) -> None:
        self.endpoint = endpoint
        self.job = job
        self.sender = sender
        self._seq = itertools.count(1)
        self.sock = _configure(ctx.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.SNDHWM, 64)
        # A routing id of our own survives reconnects, so the scheduler and the shards, which bind a member
        # to the connection it registered from, still know us after a dropped TCP connection. It is random
        # and never disclosed to other peers (a leading zero byte is reserved by ZeroMQ).
        self.sock.setsockopt(zmq.ROUTING_ID, b"d" + secrets.token_bytes(15))
        curve = _CURVE.get(ctx)
        if curve is not None:
            secure_client(self.sock, curve.keys)
        self.sock.connect(endpoint)
        self._drops: zmq.Socket[bytes] | None = None
        self._last_seq = 0
        self.lost_through = 0  # requests up to this seq went out before the link last dropped (`watch_drops`)
        self.down = False  # the link dropped and has not connected again (known only once `watch_drops` is called)
        self.refused = ""  # why the last handshake failed (curve.REFUSALS), "" after one succeeded (`watch_drops`)
        self.handshake_failed: Callable[[str], None] = lambda reason: None  # told each failure's reason

    def watch_drops(self, handshakes: bool = False) -> zmq.Socket[bytes]:
        """A socket that turns readable when this connection's link drops or connects again; `note_drops` then
        moves `lost_through` and sets `down` (and with `handshakes`, `refused`, at the first call).

        ZeroMQ reconnects by itself, so a server that stopped or restarted is
        otherwise invisible to a client: a request it had taken is never answered,
        and the client would wait out its whole timeout (30 s by default for a
        worker) although the server that could answer is already gone. A request
        sent after the drop waits in ZeroMQ's queue for the server to come back.
        """
        if self._drops is None:
            events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            if handshakes:  # a connection that closes at once because the keys do not match, told apart
                events |= zmq.EVENT_HANDSHAKE_SUCCEEDED | functools.reduce(operator.or_, REFUSALS)
            self._drops = self.sock.get_monitor_socket(events)
        return self._drops

    def note_drops(self) -> None:
        """Take the link's events so far: a drop loses every request sent before it, and leaves the link `down`
        until it connects again; a failed handshake sets `refused` until one succeeds."""
        while self._drops is not None and self._drops.poll(0):
            event = recv_monitor_message(self._drops)["event"]
            if event in REFUSALS:
                self.refused = REFUSALS[event]
                self.handshake_failed(self.refused)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = ""
            else:
                self.down = event == zmq.EVENT_DISCONNECTED
                if self.down:
                    self.lost_through = self._last_seq

    def writable(self) -> bool:
        """Whether ZeroMQ's send queue to the server has room for one more message now (`send` would take it).

        The queue holds `SNDHWM` messages, and ZeroMQ learns that its IO thread has taken them only every
        half queue, so a client with many requests unanswered can find it full although the server is there.
        """
        return bool(int(self.sock.get(zmq.EVENTS)) & zmq.POLLOUT)

    def send(self, body: Any, chunks: Sequence[ChunkMeta] = (), tensors: Sequence[torch.Tensor] = ()) -> int:
        """Queue a message; returns its seq, or -1 if the send queue is full (the server is gone or slow to read:
        `writable`)."""
        self.note_drops()  # a drop seen only after this send must not count against it
        seq = next(self._seq)
        msg = Message(body, list(chunks), list(tensors), self.job, self.sender, seq)
        try:
            self.sock.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return -1
        self._last_seq = seq
        return seq

    def recv(self, timeout_s: float) -> Message[Any] | None:
        """The next valid message within the timeout; invalid ones are skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return None
            try:
                return decode(self.sock.recv_multipart(copy=False))
            except ProtocolError:
                continue

    def request(
        self,
        body: Any,
        timeout_s: float,
        chunks: Sequence[ChunkMeta] = (),
        tensors: Sequence[torch.Tensor] = (),
    ) -> Message[Any]:
        """Send and wait for the matching reply; raises TimeoutError or RemoteError."""
        seq = self.send(body, chunks, tensors)
        if seq < 0:
            raise TimeoutError(f"{self.endpoint}: send queue full")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply is None:
                raise TimeoutError(f"{self.endpoint}: no reply to {body.TYPE} within {timeout_s:.1f}s")
            if reply.seq != seq:
                continue
            if isinstance(reply.body, Error):
                raise RemoteError(reply.body.code, reply.body.text)
            return reply

    def drain(self) -> list[Message[Any]]:
        """Every valid message waiting now, oldest first."""
        out = []
        while self.sock.poll(0):
            try:
                out.append(decode(self.sock.recv_multipart(copy=False)))
            except ProtocolError:
                continue
        return out

    def close(self) -> None:
        if self._drops is not None:
            self.sock.disable_monitor()
            self._drops.close(linger=0)
        self.sock.close(linger=0)
