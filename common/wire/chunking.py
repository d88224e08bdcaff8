"""The model as one flat float32 vector, cut into chunks owned by shards.

Parameters are flattened in `model.parameters()` order, which for our models is
forward order, so chunk id order is also priority order: chunk 0 is what the
next forward pass needs first. Every process derives the same layout from the
model and the job's `chunk_bytes` and shard count, so the layout never travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_BYTES = 4
BUFFERS_ID = 1 << 32  # the chunk id of the travelling buffers: beyond any layout's ids (at most 2**31 values)
BUFFERS_SHARD = 0  # the shard that holds a model's travelling buffers, whole (they are small)


@dataclass(frozen=True)
class Chunk:
    """A contiguous slice [start, start+length) of the flat vector, held by shard `owner`."""

    id: int
    start: int
    length: int
    owner: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Layout:
    """All chunks of a model and which shard holds each."""

    chunks: tuple[Chunk, ...]
    total: int
    num_shards: int

    def for_shard(self, shard: int) -> list[Chunk]:
        return [c for c in self.chunks if c.owner == shard]

    def sizes(self, shard: int) -> dict[int, int]:
        """Chunk id -> element count for one shard (what the shard validates against)."""
        return {c.id: c.length for c in self.for_shard(shard)}


def make_layout(total: int, chunk_bytes: int, num_shards: int) -> Layout:
    """Cut `total` floats into chunks of at most `chunk_bytes`, balancing bytes across shards.

    Chunks go, in priority order, to the shard holding the fewest bytes so far,
    so every shard serves some of the front of the network and the load evens out.
    A model smaller than `num_shards` chunks is cut finer, so that no shard is left
    holding nothing (a shard without chunks would have no version to serve).
    """
    if num_shards < 1:
        raise ValueError("at least one shard")
    if total < num_shards:
        raise ValueError(f"a model of {total} parameters cannot be spread over {num_shards} shards")
    per_chunk = max(1, min(chunk_bytes // FLOAT_BYTES, -(-total // num_shards)))
    load = [0] * num_shards
    chunks = []
    for cid, start in enumerate(range(0, total, per_chunk)):
        length = min(per_chunk, total - start)
        owner = min(range(num_shards), key=lambda s: (load[s], s))
        load[owner] += length
        chunks.append(Chunk(cid, start, length, owner))
    return Layout(tuple(chunks), total, num_shards)


def named_travelling(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that train and travel, with their names, in registration order; frozen ones
    (requires_grad False) never leave the worker and get no update."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def travelling(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in named_travelling(model)]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """A copy of the model's trainable parameters as one float32 vector on the CPU (where the wire reads it)."""
    return torch.cat([p.detach().reshape(-1).float() for p in travelling(model)]).cpu()


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """The model's gradients as one float32 vector on the CPU (zeros where a parameter has none)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in travelling(model)]
    ).cpu()


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's trainable parameters in place."""
    offset = 0
    with torch.no_grad():
        for p in travelling(model):
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, model has {offset}")


@dataclass(frozen=True)
class TravellingBuffers:
    """The buffers a training forward changes (BatchNorm's running statistics), by name, as one flat vector.

    They travel beside the parameters as one extra chunk entry (id `BUFFERS_ID`),
    held whole by shard `BUFFERS_SHARD` (0): a worker sends its buffers with each push, every pull
    returns the shard's, and the worker loads them before its next step (how
    shard 0 averages them: ps/shared_buffers.py). With no names nothing is read
    or sent, so a model without such buffers pays nothing.
    Buffers are looked up by name on every use: `model.to(device)` replaces them.
    """

    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.names)

    def read(self, model: torch.nn.Module) -> torch.Tensor | None:
        """A copy of the model's travelling buffers as one float32 vector on the CPU; None when there are none."""
        if not self.names:
            return None
        return torch.cat([model.get_buffer(n).detach().reshape(-1).float() for n in self.names]).cpu()

    def load(self, model: torch.nn.Module, flat: torch.Tensor | None) -> None:
        """Copy `flat` into the model's travelling buffers in place (in their own dtype and device); None: nothing."""
        if flat is None:
            return
        offset = 0
        with torch.no_grad():
            for name in self.names:
                buf = model.get_buffer(name)
                n = buf.numel()
                buf.copy_(flat[offset : offset + n].view_as(buf))
                offset += n
        if offset != flat.numel():
            raise ValueError(f"flat buffer vector has {flat.numel()} values, the model's buffers {offset}")
