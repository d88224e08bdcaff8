"""A worker's view of the parameter servers: pull the model, push gradients.

Requests go to every shard at once and the replies are collected as they come,
so S shards cost one round trip, not S. Gradients travel as views of the flat
gradient vector (no copies); received chunks are copied once, into the flat
parameter vector. A model's travelling buffers (BatchNorm's running statistics,
common/wire/chunking.py's TravellingBuffers) ride along with shard 0 as one more
chunk entry: with every push, and in the answer to every full pull.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from dynabatch.common import staleness
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.wire.chunking import BUFFERS_ID, BUFFERS_SHARD, Chunk, Layout
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ChunkMeta, Message
from dynabatch.common.wire.messages import Error, Init, InitAck, Params, Pull, Push, PushAck


@dataclass(frozen=True)
class ModelVersions:
    """The versions a model's parameters hold: each chunk's and each shard's."""

    chunk_versions: dict[int, int]
    shard_versions: list[int]

    @property
    def version(self) -> int:
        """The model's version: the least advanced shard's."""
        return min(self.shard_versions)


@dataclass(frozen=True)
class PullResult(ModelVersions):
    """The model as pulled: its versions, the flat parameters, the buffers.

    `flat` is the client's receive buffer, valid until the next pull: a fresh 40 MB
    tensor per pull costs more in page faults than the transfer itself. So is
    `buffers`, the travelling buffers (None when the model has none or the pull
    did not ask for them).
    """

    flat: torch.Tensor
    buffers: torch.Tensor | None = None


class ShardClients:
    """One DEALER per shard, with scatter/gather requests."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoints: list[str],
        layout: Layout,
        job: str,
        sender: str,
        idle: Callable[[], None] = lambda: None,
        idle_every_s: float = 0.5,
        buffer_total: int = 0,
    ) -> None:
        """`idle` runs every `idle_every_s` while a request waits (the worker heartbeats there,
        so a slow or restarting shard does not make the scheduler think the worker died);
        `buffer_total` is the length of the model's flat travelling buffers (0: none travel)."""
        if len(endpoints) != layout.num_shards:
            raise ValueError(f"{len(endpoints)} shard endpoints for a layout of {layout.num_shards} shards")
        self.layout = layout
        self.idle = idle
        self.idle_every_s = idle_every_s
        self.conns = [Connection(ctx, ep, job, sender) for ep in endpoints]
        self.poller = zmq.Poller()
        for conn in self.conns:
            self.poller.register(conn.sock, zmq.POLLIN)
            self.poller.register(conn.watch_drops(), zmq.POLLIN)
        self.flat = torch.zeros(layout.total)
        self.buffers = torch.zeros(buffer_total) if buffer_total else None
        self.moved_bytes = 0
        self.staleness: list[int] = []
        self.protocol = ""  # the protocol this worker steps under, which every PUSH names ("": not named)

    def start_pull(self, min_versions: list[int] | None = None, ids: list[int] | None = None) -> PendingPull:
        """Ask every shard for its chunks (or just `ids`); shards stream one PARAMS per chunk, front first.

        With `min_versions` a shard sends each chunk once it has reached that version.
        A pull of every chunk also asks shard 0 for the travelling buffers, if the model has some.
        TimeoutError (a step's retriable failure) if a shard's send queue cannot take the request.
        """
        wanted = {c.id for c in self.layout.chunks} if ids is None else set(ids)
        with_buffers = self.buffers is not None and ids is None
        seqs = []
        for s, conn in enumerate(self.conns):
            mine = sorted(c.id for c in self.layout.for_shard(s) if c.id in wanted)
            body = Pull(
                ids=[] if ids is None else mine,
                min_version=min_versions[s] if min_versions else 0,
                buffers=with_buffers and s == BUFFERS_SHARD,
            )
            seqs.append(conn.send(body) if mine else -1)
            if mine and seqs[-1] == -1:  # not sent: no chunk will come, so the pull would wait to its timeout
                raise TimeoutError(f"the send queue to shard {s} is full; the pull was not sent")
        return PendingPull(self, seqs, wanted, with_buffers)

    def start_push(
        self,
        tensor: torch.Tensor,
        chunk_versions: dict[int, int],
        samples: int,
        loss: float,
        kind: str = "grad",
        ids: list[int] | None = None,
        buffers: torch.Tensor | None = None,
        then_pull: bool = False,
        min_versions: list[int] | None = None,
    ) -> PendingPush:
        """Send `tensor`'s chunks (all, or `ids`) to their shards, tagged with the versions they came from;
        `buffers` (the worker's travelling buffers) go to shard 0, which must be sent chunks too.

        With `then_pull` (a push of every chunk) each shard also answers with every chunk it
        holds, at `min_versions` if given: the pull of the next step, in this round trip
        (`PendingPush.pull`).
        """
        if then_pull and ids is not None:
            raise ValueError("a push that is also a pull sends every chunk")
        wanted = {c.id for c in self.layout.chunks} if ids is None else set(ids)
        seqs, bodies = [], []
        for s in range(len(self.conns)):
            chunks = [c for c in self.layout.for_shard(s) if c.id in wanted]
            if not chunks and s == BUFFERS_SHARD and buffers is not None:
                raise ValueError("travelling buffers go with a push to shard 0, and this push sends it nothing")
            bodies.append(
                Push(
                    samples=samples,
                    loss=loss,
                    kind=kind,
                    protocol=self.protocol,
                    then_pull=then_pull,
                    pull_min_version=min_versions[s] if then_pull and min_versions else 0,
                )
            )
            travelling = buffers if s == BUFFERS_SHARD else None
            seqs.append(self._send_push(s, chunks, tensor, chunk_versions, bodies[s], travelling) if chunks else -1)
            if chunks and seqs[-1] == -1:  # not sent: no acknowledgement will come, so it must not count as done
                raise TimeoutError(f"the send queue to shard {s} is full; push only when it has room (can_push)")
        pull = PendingPull(self, seqs, wanted, self.buffers is not None) if then_pull else None
        return PendingPush(self, seqs, bodies, pull, Resend(tensor, chunk_versions, buffers))

    def can_push(self, ids: list[int]) -> bool:
        """Whether a push of chunks `ids` would find room in the send queue of every shard it goes to."""
        owners = {self.layout.chunks[cid].owner for cid in ids}
        return all(self.conns[s].writable() for s in owners)

    def _send_push(
        self,
        shard: int,
        chunks: list[Chunk],
        tensor: torch.Tensor,
        chunk_versions: dict[int, int],
        body: Push,
        buffers: torch.Tensor | None,
    ) -> int:
        """One PUSH of `chunks` of `tensor` (and `buffers`, as the last entry) to `shard`; returns its seq."""
        metas = [ChunkMeta(c.id, "float32", (c.length,), chunk_versions[c.id]) for c in chunks]
        tensors = [tensor[c.start : c.stop] for c in chunks]
        _append_buffers(metas, tensors, buffers)
        self.moved_bytes += sum(m.nbytes for m in metas)
        return self.conns[shard].send(body, metas, tensors)

    def init(
        self, init: Init, flat: torch.Tensor, timeout_s: float, buffers: torch.Tensor | None = None
    ) -> list[InitAck]:
        """Offer this worker's model to every shard (each gets its chunks of `flat`, shard 0 also the
        travelling `buffers`), blocking for the answers.

        The first offer a shard gets initialises it; every later one is checked
        against the model it holds, and a different model is refused (RemoteError
        `signature`, naming the first differing parameter or buffer).
        """
        seqs = []
        for s, conn in enumerate(self.conns):
            chunks = self.layout.for_shard(s)
            metas = [ChunkMeta(c.id, "float32", (c.length,), 0) for c in chunks]
            tensors = [flat[c.start : c.stop] for c in chunks]
            _append_buffers(metas, tensors, buffers if s == BUFFERS_SHARD else None)
            seqs.append(conn.send(init, metas, tensors))
        pending = PendingInit(seqs)
        self.wait(pending, timeout_s)
        return [pending.acks[s] for s in sorted(pending.acks)]

    def pull(self, min_versions: list[int] | None, timeout_s: float) -> PullResult:
        """Every chunk, blocking until all have arrived."""
        pending = self.start_pull(min_versions)
        self.wait(pending, timeout_s)
        return pending.result()

    def push(
        self,
        tensor: torch.Tensor,
        chunk_versions: dict[int, int],
        samples: int,
        loss: float,
        timeout_s: float,
        kind: str = "grad",
        buffers: torch.Tensor | None = None,
        beside: PendingPull | None = None,
    ) -> list[PushAck]:
        """Every chunk of `tensor` (and `buffers` to shard 0), blocking until every shard has acknowledged;
        `beside` (a pull sent earlier) is fed the replies that come meanwhile."""
        return self.finish_push(
            self.start_push(tensor, chunk_versions, samples, loss, kind, buffers=buffers), timeout_s, beside
        )

    def push_pull(
        self,
        tensor: torch.Tensor,
        chunk_versions: dict[int, int],
        samples: int,
        loss: float,
        timeout_s: float,
        min_versions: list[int] | None = None,
        buffers: torch.Tensor | None = None,
    ) -> tuple[PullResult, float]:
        """`push`, and the model after it in the same round trip: (the pull, seconds until every shard answered).

        The pulled model lands in the client's receive buffer, like `pull`'s.
        """
        start = time.perf_counter()
        pending = self.start_push(
            tensor, chunk_versions, samples, loss, buffers=buffers, then_pull=True, min_versions=min_versions
        )
        pull = pending.pull
        assert pull is not None  # a push with then_pull has one
        self.finish_push(pending, timeout_s)
        return pull.result(), pending.answered_at - start

    def finish_push(self, pending: PendingPush, timeout_s: float, beside: PendingPull | None = None) -> list[PushAck]:
        """Wait for `pending` (and its pull, if it has one), resending to shards that did not know this worker
        yet; replies to `beside` are taken too, not dropped."""
        deadline = time.monotonic() + timeout_s
        fed: list[Pending] = [pending] if beside is None else [pending, beside]
        while True:
            self.wait(fed, max(0.0, deadline - time.monotonic()), until=pending.done)
            if not pending.refused:
                return [pending.acks[s] for s in sorted(pending.acks)]
            self._resend_refused(pending, deadline, fed)

    def _resend_refused(self, pending: PendingPush, deadline: float, fed: list[Pending]) -> None:
        """Resend to the shards that did not know this worker yet, and only to them.

        A new worker's first push can reach a shard before the scheduler's next
        heartbeat answer has told the shard about it. Sending the whole push
        again would give the shards that took it the gradient twice.
        """
        refused = pending.refused
        if time.monotonic() >= deadline:
            raise RemoteError(ErrorCode.UNKNOWN_SENDER, f"shards {sorted(refused)} do not know this worker")
        self.before_resend([p for p in fed if p is not pending])
        for s in refused:
            again = pending.resend
            pending.seqs[s] = self._send_push(
                s,
                self.layout.for_shard(s),
                again.tensor,
                again.chunk_versions,
                pending.bodies[s],
                again.buffers if s == BUFFERS_SHARD else None,
            )
        pending.refused = set()

    def before_resend(self, others: list[Pending]) -> None:
        """Pause for one heartbeat interval before resending what a shard refused as from an unknown sender,
        feeding `others` meanwhile, then heartbeat: `idle` raises once the scheduler has dropped this worker,
        which a shard that keeps refusing would otherwise hide until the request's deadline."""
        self.advance(others, self.idle_every_s)
        self.idle()

    def wait(
        self, pendings: Pending | list[Pending], timeout_s: float, until: Callable[[], bool] | None = None
    ) -> None:
        """Feed replies to `pendings` until `until()` (default: all complete); TimeoutError past the timeout.

        Messages are taken one at a time, so waiting for the first chunk does not
        also wait for (or account for) the ones behind it. `idle` runs every
        `idle_every_s` of the wait, however busy the sockets are: a shard that keeps
        refusing must not keep the worker from hearing that the scheduler dropped it.
        """
        pendings = pendings if isinstance(pendings, list) else [pendings]
        until = until or (lambda: all(p.done() for p in pendings))
        now = time.monotonic()
        deadline, next_idle = now + timeout_s, now + self.idle_every_s
        while not until():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no complete reply from the shards within {timeout_s:.1f}s")
            if now >= next_idle:
                self.idle()
                next_idle = now + self.idle_every_s
            self.advance(pendings, min(deadline, next_idle) - now, until)

    def advance(self, pendings: list[Pending], timeout_s: float = 0.0, until: Callable[[], bool] | None = None) -> None:
        """Feed replies arriving within `timeout_s` to the requests they answer (and fail those a dropped
        link leaves unanswered)."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        for s, conn in enumerate(self.conns):
            while conn.sock in ready and conn.sock.poll(0):
                msg = conn.recv(0)
                if msg is None:
                    break
                for pending in pendings:
                    # An ERROR that names no request (the shard refused before it could read a seq) answers
                    # one of ours on this connection: every request to that shard fails rather than waits.
                    unnamed = isinstance(msg.body, Error) and msg.seq == -1 and pending.seqs[s] != -1
                    if pending.seqs[s] == msg.seq or unnamed:
                        if isinstance(msg.body, Error):
                            pending.refuse(s, msg.body)
                        else:
                            pending.take(s, msg)
                if until is not None and until():
                    return
        for s, conn in enumerate(self.conns):
            if conn.watch_drops() in ready:
                conn.note_drops()
            if conn.lost_through:  # a send may have noted the drop: the requests before it are checked here
                self._lost(s, pendings)

    def _lost(self, shard: int, pendings: list[Pending]) -> None:
        """What shard `shard` was asked before its link dropped and has not answered fails now, not at the timeout.

        The shard stopped or restarted, and a restarted one knows nothing of the
        requests its predecessor took. The worker's step fails, and it retries at
        once; the retry waits in ZeroMQ's queue until the shard is back.
        """
        conn = self.conns[shard]
        for pending in pendings:
            if 0 < pending.seqs[shard] <= conn.lost_through and not pending.done():
                pending.refuse(
                    shard,
                    Error(
                        code=ErrorCode.SHARD_LOST,
                        text=f"the link to shard {shard} ({conn.endpoint}) "
                        "dropped before it answered: it stopped or restarted",
                    ),
                )

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _append_buffers(metas: list[ChunkMeta], tensors: list[torch.Tensor], buffers: torch.Tensor | None) -> None:
    """The travelling buffers as a message's last chunk entry, where shard 0 looks for them."""
    if buffers is not None:
        metas.append(ChunkMeta(BUFFERS_ID, "float32", (buffers.numel(),), 0))
        tensors.append(buffers)


class Pending:
    """An outstanding request to every shard, matched by each shard's request seq."""

    seqs: list[int]

    def take(self, shard: int, msg: Message[Any]) -> None:
        raise NotImplementedError

    def refuse(self, shard: int, error: Error) -> None:
        """A shard answered ERROR: by default the whole request fails."""
        raise RemoteError(error.code, error.text)

    def done(self) -> bool:
        raise NotImplementedError


class PendingInit(Pending):
    """Every shard's answer to an INIT."""

    def __init__(self, seqs: list[int]) -> None:
        self.seqs = seqs
        self.acks: dict[int, InitAck] = {}

    def take(self, shard: int, msg: Message[Any]) -> None:
        if not isinstance(msg.body, InitAck):
            raise RemoteError(ErrorCode.UNEXPECTED_TYPE, f"shard {shard} answered an INIT with {msg.type}")
        self.acks[shard] = msg.body

    def done(self) -> bool:
        return len(self.acks) == len(self.seqs)


class PendingPull(Pending):
    """Chunks arriving into the client's flat buffer, with the time each one landed; with `with_buffers`
    the travelling buffers too (from shard 0, beside its first chunk), into the client's buffer vector."""

    def __init__(self, client: ShardClients, seqs: list[int], wanted: set[int], with_buffers: bool = False) -> None:
        self.client = client
        self.seqs = seqs
        self.wanted = wanted
        self.with_buffers = with_buffers
        self.buffers_in = False
        self.versions: dict[int, int] = {}
        self.arrived_at: dict[int, float] = {}

    def take(self, shard: int, msg: Message[Any]) -> None:
        layout = self.client.layout
        for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
            if meta.id == BUFFERS_ID:
                self._take_buffers(shard, meta, tensor)
                continue
            if meta.id not in self.wanted or layout.chunks[meta.id].owner != shard or meta.id in self.versions:
                raise RemoteError(
                    ErrorCode.BAD_CHUNK, f"shard {shard} sent chunk {meta.id} unasked, not its own, or twice"
                )
            chunk = layout.chunks[meta.id]
            self.client.flat[chunk.start : chunk.stop].copy_(tensor)
            self.client.moved_bytes += meta.nbytes
            self.versions[meta.id] = meta.version
            self.arrived_at[meta.id] = time.perf_counter()

    def _take_buffers(self, shard: int, meta: ChunkMeta, tensor: torch.Tensor) -> None:
        target = self.client.buffers
        if (
            not self.with_buffers
            or shard != BUFFERS_SHARD
            or self.buffers_in
            or target is None
            or meta.numel != target.numel()
        ):
            raise RemoteError(
                ErrorCode.BAD_CHUNK, f"shard {shard} sent buffers unasked, twice, or of {meta.numel} values"
            )
        target.copy_(tensor)
        self.client.moved_bytes += meta.nbytes
        self.buffers_in = True

    def has(self, ids: set[int]) -> bool:
        return ids <= self.versions.keys()

    def done(self) -> bool:
        return len(self.versions) == len(self.wanted) and self.buffers_in == self.with_buffers

    def result(self) -> PullResult:
        layout = self.client.layout
        shard_versions = [
            min((self.versions[c.id] for c in layout.for_shard(s) if c.id in self.versions), default=0)
            for s in range(layout.num_shards)
        ]
        return PullResult(
            dict(self.versions),
            shard_versions,
            flat=self.client.flat,
            buffers=self.client.buffers if self.with_buffers else None,
        )


@dataclass
class Resend:
    """What a push sent, kept to send it again to a shard that did not know the worker yet."""

    tensor: torch.Tensor
    chunk_versions: dict[int, int]
    buffers: torch.Tensor | None


class PendingPush(Pending):
    """Acknowledgements of one push, one per shard that was sent chunks; with `pull` (a push that is
    also a pull), the chunks that come under the same seqs. A shard sends each chunk back as soon as it
    has applied it, so its chunks may come before its acknowledgement, which reports the whole push;
    `answered_at` is when the last shard to answer first did (its acknowledgement or its first chunk):
    the end of the push's own trip, the rest being the pull's."""

    def __init__(
        self, client: ShardClients, seqs: list[int], bodies: list[Push], pull: PendingPull | None, resend: Resend
    ) -> None:
        self.client = client
        self.seqs = seqs
        self.bodies = bodies
        self.pull = pull
        self.resend = resend
        self.acks: dict[int, PushAck] = {}
        self.refused: set[int] = set()
        self.answered: set[int] = set()
        self.answered_at = 0.0

    def take(self, shard: int, msg: Message[Any]) -> None:
        if shard not in self.answered:
            self.answered.add(shard)
            self.answered_at = time.perf_counter()
        if isinstance(msg.body, Params):
            if self.pull is None:
                raise RemoteError(ErrorCode.BAD_CHUNK, f"shard {shard} answered a push that is not a pull with chunks")
            self.pull.take(shard, msg)
            return
        if not isinstance(msg.body, PushAck):
            raise RemoteError(ErrorCode.UNEXPECTED_TYPE, f"shard {shard} answered a push with {msg.type}")
        self.acks[shard] = msg.body
        staleness.record(self.client.staleness, msg.body.staleness)

    def refuse(self, shard: int, error: Error) -> None:
        """`unknown_sender` is worth resending to that shard alone; anything else fails the push."""
        if error.code != ErrorCode.UNKNOWN_SENDER:
            raise RemoteError(error.code, error.text)
        self.refused.add(shard)

    def done(self) -> bool:
        acked = len(self.acks) + len(self.refused) == sum(1 for s in self.seqs if s != -1)
        return acked and (self.pull is None or bool(self.refused) or self.pull.done())
