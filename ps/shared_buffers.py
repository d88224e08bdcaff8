"""The job's copy of the model's travelling buffers (BatchNorm's running statistics), held by shard 0.

A forward pass in training mode changes these buffers on the worker that ran it;
left there, each worker's would drift on its own and the evaluator (and the
export) would see only the factory's. So they travel: every pull returns the
shard's buffers B and the worker loads them before its next step; every push
carries the worker's buffers b after that step (or its H local steps). The
shard keeps what it last sent each worker, B_sent, and takes the worker's own
change, b - B_sent, rebased onto B as it is now. Once per model update (each
push under asgd and ssp, each round under ssgd, softsync, local and msd) it
applies the sample-weighted mean of the changes pushed since the last update:

    B += sum_i samples_i * (b_i - B_sent_i) / sum_i samples_i

With one worker this is exactly the running statistics of single-process torch.
With several, the statistics take one step per parameter update, as in one
process, each the average of the workers' steps. (Under local and msd a step is
a worker's H local steps, so the statistics describe the workers' models before
the round's averaging; an msd worker keeps its own statistics when it corrects
onto the averaged model, worker/local_steps.py.) Two simpler rules fail under
asynchrony (bench/RESULTS.md 16): blending B toward b by samples / global batch
drags B back toward the stale estimate b was computed from, and moves it once
per global batch while asgd moves the parameters n times.

Buffers are not gradients: no optimizer and no protocol rule sees them. A push's
buffers are taken only once the push itself has been (a refused push leaves no
trace), and applied when the server sees an update applied. They are one flat
float32 vector, small beside the parameters, held whole by shard 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dynabatch.common.wire.chunking import BUFFERS_ID
from dynabatch.common.wire.frames import Message, check_chunks, check_finite
from dynabatch.common.wire.model_signature import ParamSpec


@dataclass
class SharedBuffers:
    """The flat buffer vector `values` (the signature's `specs`, in order), what each peer was last sent,
    and the changes pushed since the last update. `values` is replaced, never written in place: a pull's
    answer may still be sending it, and `sent` holds references to it."""

    specs: tuple[ParamSpec, ...]
    values: torch.Tensor
    sent: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: torch.Tensor | None = None  # sum of samples * (b - B_sent) since the last update
    pending_samples: int = 0

    @classmethod
    def initial(cls, specs: tuple[ParamSpec, ...], flat: torch.Tensor | None) -> SharedBuffers:
        """The buffers at `flat` (the first worker's INIT); None: zeros, a checkpoint's values follow."""
        total = sum(math.prod(s.shape) for s in specs)
        values = torch.zeros(total) if flat is None else flat.detach().float().clone()
        if values.numel() != total:
            raise ValueError(f"{values.numel()} buffer values for buffers of {total}")
        return cls(specs, values)

    @property
    def total(self) -> int:
        return self.values.numel()

    def sent_to(self, peer: str) -> torch.Tensor:
        """The buffers to send `peer` now, remembered as the base of its next push."""
        self.sent[peer] = self.values
        return self.values

    def take(self, worker: str, worker_values: torch.Tensor, samples: int) -> None:
        """A worker's buffers after its step(s) on `samples` samples: its change waits for the next update.

        A worker the shard sent nothing yet (a restart in between) is taken as
        having started from the current buffers.
        """
        change = (worker_values.float() - self.sent.get(worker, self.values)) * samples
        self.pending = change if self.pending is None else self.pending + change
        self.pending_samples += samples

    def settle(self) -> bool:
        """The model was updated: apply the sample-weighted mean change pushed since the last update, if any."""
        if self.pending is None:
            return False
        self.values = self.values + self.pending / self.pending_samples
        self.pending, self.pending_samples = None, 0
        return True

    def forget(self, keep: set[str]) -> None:
        """Drop what was sent to peers not in `keep` (workers that left, the evaluator): the table stays bounded."""
        self.sent = {peer: sent for peer, sent in self.sent.items() if peer in keep}

    def named(self) -> dict[str, torch.Tensor]:
        """{name: tensor of its shape} in float32: what a checkpoint holds and `dynabatch export` reads."""
        out, offset = {}, 0
        for spec in self.specs:
            n = math.prod(spec.shape)
            out[spec.name] = self.values[offset : offset + n].view(spec.shape)
            offset += n
        return out

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Load `named()` as a checkpoint kept it; ValueError if it holds other buffers."""
        if list(saved) != [s.name for s in self.specs] or any(
            tuple(saved[s.name].shape) != s.shape for s in self.specs
        ):
            raise ValueError(f"checkpoint holds buffers {list(saved)}, this model {[s.name for s in self.specs]}")
        self.values = torch.cat([saved[s.name].reshape(-1).float() for s in self.specs])


def take_buffers(msg: Message[Any], total: int) -> torch.Tensor | None:
    """Remove the travelling buffers' entry (always the last) from `msg` (an INIT or a PUSH) and return it,
    checked; None if absent. With `total` 0 (this shard holds no buffers) the entry is left in place, where
    check_chunks refuses it as a chunk not held here."""
    if not total or not msg.chunks or msg.chunks[-1].id != BUFFERS_ID:
        return None
    part = Message(msg.body, [msg.chunks.pop()], [msg.tensors.pop()], seq=msg.seq)
    check_chunks(part, {BUFFERS_ID: total})
    check_finite(part)
    return part.tensors[0]
