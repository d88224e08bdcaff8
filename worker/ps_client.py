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
        """All chunks from all shards; with `min_versions` each shard sends a chunk once it has reached it.

        Shards stream one PARAMS message per chunk, in priority order.
        """
        seqs = [conn.send(Pull(min_version=min_versions[s] if min_versions else 0)) for s, conn in enumerate(self.conns)]
        versions: dict[int, int] = {}
        expected = [len(self.layout.for_shard(s)) for s in range(len(self.conns))]
        received = [0] * len(self.conns)

        def take(shard: int, msg: Message) -> None:
            for meta, tensor in zip(msg.chunks, msg.tensors):
                chunk = self.layout.chunks[meta.id]
                if chunk.owner != shard or meta.id in versions:
                    raise RemoteError("bad_chunk", f"shard {shard} sent chunk {meta.id} it does not own or twice")
                self.flat[chunk.start : chunk.stop].copy_(tensor)
                versions[meta.id] = meta.version
                received[shard] += 1

        self._collect(seqs, lambda shard: received[shard] >= expected[shard], take, timeout_s)
        shard_versions = [min(versions[c.id] for c in self.layout.for_shard(s)) for s in range(len(self.conns))]
        return PullResult(self.flat.clone(), versions, shard_versions)

    def push(
        self, tensor: torch.Tensor, chunk_versions: dict[int, int], samples: int, loss: float, timeout_s: float,
        kind: str = "grad",
    ) -> list[PushAck]:
        """Every shard's chunks of `tensor` (a gradient or a delta), tagged with the versions they came from."""
        seqs = []
        for s, conn in enumerate(self.conns):
            chunks = self.layout.for_shard(s)
            metas = [ChunkMeta(c.id, "float32", (c.length,), chunk_versions[c.id]) for c in chunks]
            seqs.append(conn.send(Push(samples=samples, loss=loss, kind=kind), metas,
                                  [tensor[c.start : c.stop] for c in chunks]))
        acks: dict[int, PushAck] = {}
        self._collect(seqs, lambda shard: shard in acks, lambda shard, msg: acks.__setitem__(shard, msg.body), timeout_s)
        return [acks[s] for s in range(len(self.conns))]

    def _collect(
        self, seqs: list[int], done: Callable[[int], bool], take: Callable[[int, Message], None], timeout_s: float
    ) -> None:
        """Feed every reply matching shard s's request seq to `take` until `done(s)` for all shards."""
        poller = zmq.Poller()
        for conn in self.conns:
            poller.register(conn.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not all(done(s) for s in range(len(self.conns))):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [self.conns[s].endpoint for s in range(len(self.conns)) if not done(s)]
                raise TimeoutError(f"no complete reply from shards {missing} within {timeout_s:.1f}s")
            ready = dict(poller.poll(int(min(remaining, self.idle_every_s) * 1000) + 1))
            if not ready:
                self.idle()
            for s, conn in enumerate(self.conns):
                if conn.sock not in ready:
                    continue
                for msg in conn.drain():
                    if msg.seq != seqs[s]:
                        continue
                    if isinstance(msg.body, Error):
                        raise RemoteError(msg.body.code, msg.body.text)
                    take(s, msg)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
