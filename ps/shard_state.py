"""A shard's model state, without sockets.

State is kept per chunk: each chunk has its parameters, optimizer buffer and
version, and the protocol's rule (protocol_rules.py) keeps each chunk's open
round. That is what lets a worker push a chunk's gradient the moment backward
has finished it, and lets a shard apply and serve chunks in priority order, one
at a time.

The server loop (server.py) decodes and validates messages, then calls
`pull`, `push`, `set_membership`, `overdue` and `close_round` here. Everything
that decides what the parameters become is in this file, protocol_rules.py and
update_rules.py, and is tested directly against plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dynabatch.common.chunking import Chunk
from dynabatch.common.protocols import ProtocolSpec, protocol_spec
from dynabatch.common.wire import ProtocolError
from dynabatch.ps.protocol_rules import RULES, ShardRule
from dynabatch.ps.update_rules import OuterConfig, SGDConfig, outer_step, sgd_step


@dataclass
class PushOutcome:
    """What a push did: `applied` lists the chunks it updated now (others wait in a round)."""

    applied: list[int]
    version: int
    staleness: int


@dataclass
class ShardState:
    """Parameter chunks, optimizer buffers, versions, the live workers and the protocol's rule.

    `allocated` is the number of workers the scheduler gave a batch (DBS-SGD's n);
    `live` can be larger while a worker joins.
    """

    chunks: list[Chunk]
    sgd: SGDConfig
    protocol: str
    global_batch: int
    outer: OuterConfig = field(default_factory=OuterConfig)
    softsync_n: int = 1
    staleness_bound: int = 0
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    momentum: dict[int, torch.Tensor] = field(default_factory=dict)
    chunk_versions: dict[int, int] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    allocated: int = 0
    lr_factor: float = 1.0  # the task's schedule at the job's progress
    spec: ProtocolSpec = field(init=False)
    rule: ShardRule = field(init=False)

    def __post_init__(self) -> None:
        self.spec = protocol_spec(self.protocol)
        self.rule = RULES[self.spec.shard_rule](self)

    @classmethod
    def initial(
        cls, chunks: Sequence[Chunk], flat: torch.Tensor, sgd: SGDConfig, protocol: str, global_batch: int,
        outer: OuterConfig = OuterConfig(), softsync_n: int = 1, staleness_bound: int = 0,
    ) -> "ShardState":
        """State at version 0 from the model's initial flat parameters."""
        state = cls(sorted(chunks, key=lambda c: c.id), sgd, protocol, global_batch, outer, softsync_n,
                    staleness_bound)
        for c in state.chunks:
            state.params[c.id] = flat[c.start : c.stop].clone()
            state.momentum[c.id] = torch.zeros(c.length)
            state.chunk_versions[c.id] = 0
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
        return self.spec.push_kind

    def pull(self, ids: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(id, tensor, version) for the asked chunks (all when `ids` is empty), in priority order."""
        wanted = sorted(set(ids)) if ids else [c.id for c in self.chunks]
        unknown = [i for i in wanted if i not in self.params]
        if unknown:
            raise ProtocolError("unknown_chunk", f"chunks {unknown[:5]} are not held here")
        return [(i, self.params[i], self.chunk_versions[i]) for i in wanted]

    def pull_blocked(self, worker: str) -> bool:
        """Whether the protocol holds back `worker`'s pull for now (ssp: too far ahead of the slowest)."""
        return self.rule.pull_blocked(worker)

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
        self.rule.check(worker, list(tensors))
        staleness = {cid: max(0, self.chunk_versions[cid] - base_versions[cid]) for cid in tensors}
        applied = [cid for cid in sorted(tensors)
                   if self.rule.take(cid, worker, tensors[cid], samples, staleness[cid], now)]
        return PushOutcome(applied, self.version, max(staleness.values(), default=0))

    def set_membership(self, workers: set[str], allocated: int) -> list[int]:
        """New membership from the scheduler: the live workers and how many hold a batch.

        Rounds that waited only on workers that left close now; returns their chunks.
        """
        self.live = set(workers)
        self.allocated = allocated
        return self.rule.membership_changed()

    def overdue(self, now: float, timeout_s: float) -> list[int]:
        """Chunks whose open round has waited longer than `timeout_s`."""
        return self.rule.overdue(now, timeout_s)

    def close_round(self, cid: int) -> bool:
        """Apply chunk `cid`'s open round with whoever pushed (a worker we cannot reach is not waited on)."""
        return self.rule.close(cid)

    def apply_sgd(self, cid: int, grad: torch.Tensor, lr_scale: float) -> None:
        """One optimizer step on chunk `cid` (a rule calls this when a gradient or a round is due)."""
        self.params[cid], self.momentum[cid] = sgd_step(self.params[cid], grad, self.momentum[cid], self.sgd,
                                                        lr_scale * self.lr_factor)
        self.chunk_versions[cid] += 1

    def apply_outer(self, cid: int, delta: torch.Tensor) -> None:
        """One outer-optimizer step on chunk `cid` with the round's mean parameter delta."""
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
