"""A worker's view of the parameter servers: pull the model, push gradients.

Requests go to every shard at once and the replies are collected as they come,
so S shards cost one round trip, not S. Gradients travel as views of the flat
gradient vector (no copies); received chunks are copied once, into the flat
parameter vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from dynabatch.common.chunking import Layout
from dynabatch.common.messages import Error, Params, Pull, Push, PushAck
from dynabatch.common.transport import Connection, RemoteError
from dynabatch.common.wire import ChunkMeta, Message


@dataclass
class PullResult:
    """The model as pulled: flat parameters, each chunk's version, each shard's version."""

    flat: torch.Tensor
    chunk_versions: dict[int, int]
    shard_versions: list[int]

    @property
    def version(self) -> int:
        """The model's version: the least advanced shard's."""
        return min(self.shard_versions)


class ShardClients:
    """One DEALER per shard, with scatter/gather requests."""

    def __init__(
        self, ctx: zmq.Context, endpoints: list[str], layout: Layout, job: str, sender: str,
        idle: Callable[[], None] = lambda: None, idle_every_s: float = 0.5,
    ) -> None:
        """`idle` runs every `idle_every_s` while a request waits (the worker heartbeats there,
        so a slow or restarting shard does not make the scheduler think the worker died)."""
        if len(endpoints) != layout.num_shards:
            raise ValueError(f"{len(endpoints)} shard endpoints for a layout of {layout.num_shards} shards")
        self.layout = layout
        self.idle = idle
        self.idle_every_s = idle_every_s
        self.conns = [Connection(ctx, ep, job, sender) for ep in endpoints]
        self.flat = torch.zeros(layout.total)

    def pull(self, min_versions: list[int] | None, timeout_s: float) -> PullResult:
        """All chunks from all shards; with `min_versions` each shard answers once it has reached it."""
        bodies = [Pull(min_version=(min_versions[s] if min_versions else 0)) for s in range(len(self.conns))]
        replies = self._gather(bodies, [[] for _ in self.conns], [[] for _ in self.conns], timeout_s)
        versions: dict[int, int] = {}
        for reply in replies:
            for meta, tensor in zip(reply.chunks, reply.tensors):
                chunk = self.layout.chunks[meta.id]
                self.flat[chunk.start : chunk.stop].copy_(tensor)
                versions[meta.id] = meta.version
        if len(versions) != len(self.layout.chunks):
            raise RemoteError("bad_chunk", f"pulled {len(versions)} of {len(self.layout.chunks)} chunks")
        return PullResult(self.flat.clone(), versions, [r.body.version for r in replies])

    def push(
        self, grad: torch.Tensor, chunk_versions: dict[int, int], samples: int, loss: float, timeout_s: float
    ) -> list[PushAck]:
        """Every shard's chunks of `grad`, each tagged with the version it was computed on."""
        metas: list[list[ChunkMeta]] = []
        tensors: list[list[torch.Tensor]] = []
        for s in range(len(self.conns)):
            chunks = self.layout.for_shard(s)
            metas.append([ChunkMeta(c.id, "float32", (c.length,), chunk_versions[c.id]) for c in chunks])
            tensors.append([grad[c.start : c.stop] for c in chunks])
        bodies = [Push(samples=samples, loss=loss) for _ in self.conns]
        return [r.body for r in self._gather(bodies, metas, tensors, timeout_s)]

    def _gather(
        self, bodies: list[object], metas: list[list[ChunkMeta]], tensors: list[list[torch.Tensor]], timeout_s: float
    ) -> list[Message]:
        """Send one request per shard, then wait for every matching reply."""
        seqs = [conn.send(body, m, t) for conn, body, m, t in zip(self.conns, bodies, metas, tensors)]
        replies: list[Message | None] = [None] * len(self.conns)
        poller = zmq.Poller()
        for conn in self.conns:
            poller.register(conn.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while any(r is None for r in replies):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [self.conns[i].endpoint for i, r in enumerate(replies) if r is None]
                raise TimeoutError(f"no reply from shards {missing} within {timeout_s:.1f}s")
            ready = dict(poller.poll(int(min(remaining, self.idle_every_s) * 1000) + 1))
            if not ready:
                self.idle()
            for i, conn in enumerate(self.conns):
                if conn.sock not in ready:
                    continue
                for msg in conn.drain():
                    if msg.seq != seqs[i]:
                        continue
                    if isinstance(msg.body, Error):
                        raise RemoteError(msg.body.code, msg.body.text)
                    replies[i] = msg
        return [r for r in replies if r is not None]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
