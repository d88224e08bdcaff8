"""A shard's model state and the update protocols, without sockets.

State is kept per chunk: each chunk has its parameters, optimizer buffer,
version and (for the synchronous protocols) its own open round. That is what
lets a worker push a chunk's gradient the moment backward has finished it, and
lets a shard apply and serve chunks in priority order, one at a time.

The server loop (server.py) decodes and validates messages, then calls
`pull`, `push`, `set_live`, `overdue` and `close_round` here. Everything that
decides what the parameters become is in this file and update_rules.py, and
is tested directly against plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dynabatch.common.chunking import Chunk
from dynabatch.common.wire import ProtocolError
from dynabatch.ps.update_rules import (
    OuterConfig, SGDConfig, SoftRound, SyncRound, dbs_weight, outer_step, sgd_step, softsync_needed,
)

GRADIENT_PROTOCOLS = ("asgd", "ssgd", "softsync")
DELTA_PROTOCOLS = ("local", "msd")
SYNC_PROTOCOLS = ("ssgd", "local", "msd")


@dataclass
class PushOutcome:
    """What a push did: `applied` lists the chunks it updated now (others wait in a round)."""

    applied: list[int]
    version: int
    staleness: int


@dataclass
class ShardState:
    """Parameter chunks, optimizer buffers, versions and open rounds of one shard."""

    chunks: list[Chunk]
    sgd: SGDConfig
    protocol: str
    global_batch: int
    outer: OuterConfig = field(default_factory=OuterConfig)
    softsync_n: int = 1
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    momentum: dict[int, torch.Tensor] = field(default_factory=dict)
    chunk_versions: dict[int, int] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    rounds: dict[int, Any] = field(default_factory=dict)
    round_started: dict[int, float] = field(default_factory=dict)

    @classmethod
    def initial(
        cls, chunks: Sequence[Chunk], flat: torch.Tensor, sgd: SGDConfig, protocol: str, global_batch: int,
        outer: OuterConfig = OuterConfig(), softsync_n: int = 1,
    ) -> "ShardState":
        """State at version 0 from the model's initial flat parameters."""
        state = cls(sorted(chunks, key=lambda c: c.id), sgd, protocol, global_batch, outer, softsync_n)
        for c in state.chunks:
            state.params[c.id] = flat[c.start : c.stop].clone()
            state.momentum[c.id] = torch.zeros(c.length)
            state.chunk_versions[c.id] = 0
            state.rounds[c.id] = state._new_round()
        return state

    @property
    def version(self) -> int:
        """The shard's model version: the number of updates every one of its chunks has had."""
        return min(self.chunk_versions.values())

    @property
    def sizes(self) -> dict[int, int]:
        return {c.id: c.length for c in self.chunks}

    @property
    def kind(self) -> str:
        """What workers push: gradients, or parameter deltas."""
        return "delta" if self.protocol in DELTA_PROTOCOLS else "grad"

    def _new_round(self) -> Any:
        return SoftRound() if self.protocol == "softsync" else SyncRound()

    def pull(self, ids: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(id, tensor, version) for the asked chunks (all when `ids` is empty), in priority order."""
        wanted = sorted(set(ids)) if ids else [c.id for c in self.chunks]
        unknown = [i for i in wanted if i not in self.params]
        if unknown:
            raise ProtocolError("unknown_chunk", f"chunks {unknown[:5]} are not held here")
        return [(i, self.params[i], self.chunk_versions[i]) for i in wanted]

    def push(
        self, worker: str, tensors: dict[int, torch.Tensor], base_versions: dict[int, int],
        samples: int, kind: str, now: float,
    ) -> PushOutcome:
        """Take one worker's gradient or delta chunks; the caller has validated ids, shapes, finiteness.

        Everything is checked before anything changes, so a refused push leaves no trace.
        """
        if worker not in self.live:
            raise ProtocolError("unknown_sender", f"{worker!r} is not a live worker of this job")
        if samples <= 0:
            raise ProtocolError("bad_field", f"PUSH.samples must be positive, got {samples}")
        if kind != self.kind:
            raise ProtocolError("bad_field", f"protocol {self.protocol} takes PUSH.kind {self.kind!r}, not {kind!r}")
        if self.protocol in SYNC_PROTOCOLS:
            again = [cid for cid in tensors if worker in self.rounds[cid].contributors]
            if again:
                raise ProtocolError("bad_state", f"{worker} already pushed chunk {again[0]} in this round")
        staleness = {cid: max(0, self.chunk_versions[cid] - base_versions[cid]) for cid in tensors}
        applied = []
        for cid in sorted(tensors):
            if self._take(cid, worker, tensors[cid], samples, staleness[cid], now):
                applied.append(cid)
        return PushOutcome(applied, self.version, max(staleness.values(), default=0))

    def _take(self, cid: int, worker: str, tensor: torch.Tensor, samples: int, staleness: int, now: float) -> bool:
        """Apply or queue one chunk; True if the chunk was updated now."""
        if self.protocol == "asgd":
            self._apply(cid, tensor, dbs_weight(samples, self.global_batch, len(self.live)))
            return True
        self.round_started.setdefault(cid, now)
        if self.protocol == "softsync":
            self.rounds[cid].add(tensor, samples, staleness)
        else:
            self.rounds[cid].add(worker, {cid: tensor}, samples)
        return self._close_if_complete(cid)

    def set_live(self, workers: set[str]) -> list[int]:
        """New membership from the scheduler; rounds that waited only on leavers close. Returns them."""
        self.live = set(workers)
        return [cid for cid in self.params if self.rounds[cid] and self._close_if_complete(cid)]

    def overdue(self, now: float, timeout_s: float) -> list[int]:
        """Chunks whose open round has waited longer than `timeout_s`."""
        return [cid for cid, started in self.round_started.items() if now - started > timeout_s]

    def close_round(self, cid: int) -> bool:
        """Apply chunk `cid`'s open round with whoever pushed (a worker we cannot reach is not waited on)."""
        rnd = self.rounds[cid]
        if not rnd:
            return False
        if self.protocol == "softsync":
            self._apply(cid, rnd.combined(), 1.0)
        elif self.protocol == "ssgd":
            self._apply(cid, rnd.mean()[cid], 1.0)
        else:
            self._apply_outer(cid, rnd.mean()[cid])
        self.rounds[cid] = self._new_round()
        self.round_started.pop(cid, None)
        return True

    def _close_if_complete(self, cid: int) -> bool:
        rnd = self.rounds[cid]
        if self.protocol == "softsync":
            done = len(rnd.entries) >= softsync_needed(len(self.live), self.softsync_n)
        else:
            done = rnd.complete(self.live)
        return done and self.close_round(cid)

    def _apply(self, cid: int, grad: torch.Tensor, lr_scale: float) -> None:
        self.params[cid], self.momentum[cid] = sgd_step(self.params[cid], grad, self.momentum[cid], self.sgd, lr_scale)
        self.chunk_versions[cid] += 1

    def _apply_outer(self, cid: int, delta: torch.Tensor) -> None:
        self.params[cid], self.momentum[cid] = outer_step(self.params[cid], delta, self.momentum[cid], self.outer)
        self.chunk_versions[cid] += 1

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds, by reference: parameters are never written in place, and the
        caller saves the snapshot before the next update can touch a momentum buffer."""
        return {
            "params": dict(self.params),
            "momentum": dict(self.momentum),
            "chunk_versions": dict(self.chunk_versions),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """Load a checkpoint taken from a shard with the same chunks."""
        if set(saved["params"]) != set(self.params) or any(
            saved["params"][c.id].numel() != c.length for c in self.chunks
        ):
            raise ValueError("checkpoint holds different chunks than this shard's layout")
        self.params = dict(saved["params"])
        self.momentum = dict(saved["momentum"])
        self.chunk_versions = dict(saved["chunk_versions"])
