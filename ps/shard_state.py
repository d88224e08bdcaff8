"""A shard's model state and the update protocols, without sockets.

The server loop (server.py) decodes and validates messages, then calls
`pull`, `push`, `set_live` and `close_round` here. Everything that decides
what the parameters become is in this file and update_rules.py, so it is
tested directly against plain torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dynabatch.common.chunking import Chunk
from dynabatch.common.wire import ProtocolError
from dynabatch.ps.update_rules import SGDConfig, SyncRound, dbs_weight, sgd_step


@dataclass
class PushOutcome:
    """What a push did: applied now (asgd, or it closed an ssgd round) or queued."""

    applied: bool
    version: int
    staleness: int


@dataclass
class ShardState:
    """Parameter chunks, momentum, versions and the open ssgd round of one shard."""

    chunks: list[Chunk]
    sgd: SGDConfig
    protocol: str
    global_batch: int
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    momentum: dict[int, torch.Tensor] = field(default_factory=dict)
    chunk_versions: dict[int, int] = field(default_factory=dict)
    version: int = 0
    live: set[str] = field(default_factory=set)
    round: SyncRound = field(default_factory=SyncRound)
    round_started: float | None = None
    updates: int = 0

    @classmethod
    def initial(
        cls, chunks: Sequence[Chunk], flat: torch.Tensor, sgd: SGDConfig, protocol: str, global_batch: int
    ) -> "ShardState":
        """State at version 0 from the model's initial flat parameters."""
        state = cls(sorted(chunks, key=lambda c: c.id), sgd, protocol, global_batch)
        for c in state.chunks:
            state.params[c.id] = flat[c.start : c.stop].clone()
            state.momentum[c.id] = torch.zeros(c.length)
            state.chunk_versions[c.id] = 0
        return state

    @property
    def sizes(self) -> dict[int, int]:
        return {c.id: c.length for c in self.chunks}

    def pull(self, ids: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(id, tensor, version) for the asked chunks (all when `ids` is empty), in priority order."""
        wanted = sorted(set(ids)) if ids else [c.id for c in self.chunks]
        unknown = [i for i in wanted if i not in self.params]
        if unknown:
            raise ProtocolError("unknown_chunk", f"chunks {unknown[:5]} are not held here")
        return [(i, self.params[i], self.chunk_versions[i]) for i in wanted]

    def push(
        self, worker: str, grads: dict[int, torch.Tensor], base_version: int, samples: int, now: float
    ) -> PushOutcome:
        """Take one worker's gradient; the caller has validated ids, shapes and finiteness."""
        if worker not in self.live:
            raise ProtocolError("unknown_sender", f"{worker!r} is not a live worker of this job")
        if samples <= 0:
            raise ProtocolError("bad_field", f"PUSH.samples must be positive, got {samples}")
        staleness = max(0, self.version - base_version)
        if self.protocol == "asgd":
            self._apply(grads, dbs_weight(samples, self.global_batch, len(self.live)))
            return PushOutcome(True, self.version, staleness)
        if worker in self.round.contributors:
            raise ProtocolError("bad_state", f"{worker} already pushed in round {self.version}")
        self.round.add(worker, grads, samples)
        if self.round_started is None:
            self.round_started = now
        applied = self._close_if_complete()
        return PushOutcome(applied, self.version, staleness)

    def set_live(self, workers: set[str]) -> bool:
        """New membership from the scheduler; an ssgd round waiting only on leavers closes."""
        self.live = set(workers)
        return self.protocol == "ssgd" and self._close_if_complete()

    def round_overdue(self, now: float, timeout_s: float) -> bool:
        return self.round_started is not None and now - self.round_started > timeout_s

    def close_round(self) -> bool:
        """Apply the open round with whoever pushed (a worker we cannot reach is not waited on)."""
        if not self.round.contributors:
            return False
        self._apply(self.round.mean(), 1.0)
        self.round = SyncRound()
        self.round_started = None
        return True

    def _close_if_complete(self) -> bool:
        return self.round.complete(self.live) and self.close_round()

    def _apply(self, grads: dict[int, torch.Tensor], lr_scale: float) -> None:
        self.version += 1
        self.updates += 1
        for cid in sorted(grads):
            self.params[cid], self.momentum[cid] = sgd_step(
                self.params[cid], grads[cid], self.momentum[cid], self.sgd, lr_scale
            )
            self.chunk_versions[cid] = self.version

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds (tensors are immutable, so no copies are needed)."""
        return {
            "version": self.version,
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
        self.version = int(saved["version"])
        self.params = dict(saved["params"])
        self.momentum = dict(saved["momentum"])
        self.chunk_versions = dict(saved["chunk_versions"])
