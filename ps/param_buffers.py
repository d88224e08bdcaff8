"""Parameter memory that replies borrow without copies and steps reuse once ZeroMQ lets go of it.

A pull's answer carries each chunk as a zero-copy frame of the shard's own
tensor, and ZeroMQ may hold that frame (in its queue, or the reply in the
outbox's backlog) after the next push has stepped the chunk. So a step never
writes a tensor a reply still holds: it writes into a spare of the chunk's size
and publishes that, and the old tensor becomes a spare once every frame lent
from it is gone. The shard learns that by a weak reference to each memoryview it
lends: pyzmq drops its own reference when libzmq frees the message.

Reusing memory rather than allocating a new tensor per chunk per step saves the
page faults (and the kernel's zeroing) of fresh memory, which on the bench
machine cost as much as the step's arithmetic (bench/RESULTS.md §3b).
"""

from __future__ import annotations

import weakref

import torch

MAX_SPARES = 4  # free tensors kept per size; more are given back to the allocator


class ParamBuffers:
    """Lends tensors' memory to replies and hands out spares that no reply holds."""

    def __init__(self) -> None:
        self._loans: dict[int, tuple[torch.Tensor, list[weakref.ref[memoryview]]]] = {}  # by id(tensor): it, its frames
        self._retired: list[torch.Tensor] = []  # no longer a chunk's parameters; perhaps still lent
        self._spares: dict[int, list[torch.Tensor]] = {}  # by numel: free to write

    def lend(self, tensor: torch.Tensor) -> memoryview:
        """`tensor`'s bytes (a contiguous CPU tensor) as a memoryview to send zero-copy, remembered as lent."""
        view = tensor.numpy().data.cast("B")
        _, refs = self._loans.setdefault(id(tensor), (tensor, []))
        refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(view))
        return view

    def lent(self, tensor: torch.Tensor) -> bool:
        """Whether a frame lent from `tensor` may still be read by ZeroMQ."""
        loan = self._loans.get(id(tensor))
        return loan is not None and loan[0] is tensor and any(r() is not None for r in loan[1])

    def retire(self, tensor: torch.Tensor) -> None:
        """`tensor` is no longer a chunk's parameters: its memory is free once no reply holds it."""
        self._retired.append(tensor)

    def spare(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s size and dtype that no reply holds and nothing else uses (its values are stale)."""
        still_lent = []
        for tensor in self._retired:
            if self.lent(tensor):
                still_lent.append(tensor)
                continue
            self._loans.pop(id(tensor), None)
            free = self._spares.setdefault(tensor.numel(), [])
            if len(free) < MAX_SPARES:
                free.append(tensor)
        self._retired = still_lent
        spares = self._spares.get(like.numel())
        if spares and spares[-1].dtype == like.dtype:
            return spares.pop()
        return torch.empty_like(like)
