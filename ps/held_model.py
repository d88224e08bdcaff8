"""What a shard holds once the first INIT, or its checkpoint, has given it the model.

Its part of the model (ShardState), the set-up every later worker must match
(TrainingSetup), on shard 0 of a model that has them the travelling buffers
(SharedBuffers), and the limits on what a peer may send once the model's size is
known (peer_limits.py) are made together, so the socket loop holds one object
that is either there or not, never part of it. An INIT is checked whole before
anything is made: its set-up, then every chunk of this shard, of its size and
finite, with the buffers' entry on shard 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dynabatch.common.config import JobConfig
from dynabatch.common.wire.chunking import BUFFERS_ID, BUFFERS_SHARD
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import Message, ProtocolError, WireLimits, check_chunks, check_finite
from dynabatch.common.wire.messages import Init
from dynabatch.ps.peer_limits import wire_limits
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ShardState
from dynabatch.ps.shared_buffers import SharedBuffers, take_buffers
from dynabatch.ps.training_setup import TrainingSetup
from dynabatch.ps.update_rules import optimizer_spec


@dataclass
class HeldModel:
    """This shard's part of the model, the set-up it steps with, its travelling buffers (None: not this shard's,
    or the model has none) and the wire limits that follow from its size."""

    state: ShardState
    setup: TrainingSetup
    buffers: SharedBuffers | None
    limits: WireLimits

    @classmethod
    def made(
        cls, served: ServedJob, setup: TrainingSetup, flat: torch.Tensor | None, buffers: torch.Tensor | None
    ) -> HeldModel:
        """The model `setup` describes at `flat` and `buffers` (None: zeros, a checkpoint's values follow)."""
        sig = setup.signature
        state = served.new_state(sig, flat, setup.optimizer, setup.schedule)
        held = SharedBuffers.initial(sig.buffers, buffers) if served.index == BUFFERS_SHARD and sig.buffers else None
        limits = wire_limits(
            [c.length for c in state.chunks], held.total if held else 0, len(sig.params), len(sig.buffers)
        )
        return cls(state, setup, held, limits)

    @classmethod
    def from_init(cls, served: ServedJob, setup: TrainingSetup, msg: Message[Init]) -> HeldModel:
        """The model the first INIT `msg` (of set-up `setup`, see `init_setup`) carries; ProtocolError naming what
        is missing or malformed, before anything is made."""
        sig = setup.signature
        mine = {c.id: c for c in served.chunks(sig)}
        holds_buffers = sig.buffer_total if served.index == BUFFERS_SHARD else 0
        buffers = take_buffers(msg, holds_buffers)
        if holds_buffers and buffers is None:
            raise ProtocolError(
                ErrorCode.BAD_CHUNK, f"INIT lacks the model's {len(sig.buffers)} buffers (chunk {BUFFERS_ID})"
            )
        check_chunks(msg, {c.id: c.length for c in mine.values()})
        if len(msg.chunks) != len(mine):
            raise ProtocolError(
                ErrorCode.BAD_CHUNK, f"INIT carries {len(msg.chunks)} of this shard's {len(mine)} chunks"
            )
        check_finite(msg)
        flat = torch.zeros(sig.total)
        for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
            chunk = mine[meta.id]
            flat[chunk.start : chunk.stop] = tensor
        return cls.made(served, setup, flat, buffers)

    @classmethod
    def from_checkpoint(cls, served: ServedJob, saved: dict[str, Any]) -> HeldModel:
        """The model this shard wrote into its checkpoint `saved` (`checkpoint_fields`)."""
        held = cls.made(served, TrainingSetup.from_checkpoint(saved), None, None)
        held.restore(saved)
        return held

    @property
    def buffer_total(self) -> int:
        """The travelling buffers' length on the shard that holds them, else 0."""
        return self.buffers.total if self.buffers is not None else 0

    def restore(self, saved: dict[str, Any]) -> None:
        """Load the parameters, optimizer state and buffers of this shard's checkpoint `saved`."""
        self.state.restore(saved)
        if self.buffers is not None:
            self.buffers.restore(saved.get("buffers", {}))

    def roll_back(self, saved: dict[str, Any]) -> None:
        """Go back to the checkpoint `saved`; pushes computed on the versions it throws away are refused
        (ShardState.check_base)."""
        self.state.roll_back(saved)
        if self.buffers is not None:
            self.buffers.restore(saved.get("buffers", {}))

    def checkpoint_fields(self) -> dict[str, Any]:
        """What a checkpoint keeps of the model: the state's snapshot, the set-up, the buffers by name."""
        buffers = self.buffers.named() if self.buffers is not None else {}  # {name: tensor}, as export reads them
        return {**self.state.snapshot(), **self.setup.checkpoint_fields(), "buffers": buffers}


def init_setup(job: JobConfig, body: Init) -> TrainingSetup:
    """The set-up an INIT names; ProtocolError (`bad_field`) if it or its optimizer's fields are malformed."""
    try:
        setup = TrainingSetup.from_init(body)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"INIT: {exc}") from None
    optimizer_spec(job, body.optimizer)  # a malformed spec is refused before anything is built
    return setup
