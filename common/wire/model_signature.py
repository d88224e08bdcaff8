"""What every process of a job must agree on about the model: its trainable parameters and travelling
buffers, in order, and the training set's length (`ModelSignature`), and its form on the wire (INIT's fields).

The first worker sends it with the initial parameters; shards, later workers, the
evaluator and `dynabatch export` compare theirs against it. A signature received from
a peer is checked field by field (`signature_from_fields`) before anything is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dynabatch.common.wire.chunking import named_travelling
from dynabatch.task_error import TaskError

TRAVELLING_DTYPES = (torch.float32,)
TRAVELLING_DTYPE_NAMES = ("float32",)
BUFFER_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")  # they travel as float32 whatever they are


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as it travels: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelSignature:
    """What every process of a job must agree on: the trainable parameters, in order, the
    travelling buffers, in order, and the data's length.

    `buffers` are the floating-point buffers a training forward changes (BatchNorm's
    running mean and variance): they travel beside the parameters, as one flat float32
    vector held by shard 0, so that evaluation and export see the job's estimate rather
    than a worker's own or the factory's. Buffers a forward leaves alone, and integer
    counters such as `num_batches_tracked`, are rebuilt by the model factory and never sent.
    """

    params: tuple[ParamSpec, ...]
    train_size: int
    buffers: tuple[ParamSpec, ...] = ()

    @property
    def total(self) -> int:
        """Number of trainable values: the flat vector's length."""
        return _count(self.params)

    @property
    def buffer_total(self) -> int:
        """Number of travelling buffer values: the flat buffer vector's length (0: nothing travels)."""
        return _count(self.buffers)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)

    def difference(self, other: ModelSignature) -> str | None:
        """A sentence naming the first difference from `other`, or None if they match."""
        found = _first_difference("parameter", "trainable parameters", self.params, other.params) or _first_difference(
            "buffer", "travelling buffers", self.buffers, other.buffers
        )
        if found is None and self.train_size != other.train_size:
            found = f"the training set holds {self.train_size} samples here, {other.train_size} in the job"
        return found


def _count(specs: tuple[ParamSpec, ...]) -> int:
    return sum(math.prod(s.shape) for s in specs)


def _first_difference(what: str, plural: str, mine: tuple[ParamSpec, ...], theirs: tuple[ParamSpec, ...]) -> str | None:
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return (
                f"{what} {i} is {a.name} {list(a.shape)} {a.dtype} here but "
                f"{b.name} {list(b.shape)} {b.dtype} in the job"
            )
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))]
        return f"{len(mine)} {plural} here, {len(theirs)} in the job (first unmatched: {extra.name})"
    return None


def signature(model: nn.Module, train_size: int, buffers: tuple[ParamSpec, ...] = ()) -> ModelSignature:
    """The model's signature; TaskError for a parameter of a dtype that cannot travel."""
    params = []
    for name, p in named_travelling(model):
        if p.dtype not in TRAVELLING_DTYPES:
            raise TaskError(
                f"parameter {name} is {p.dtype}; trainable parameters must be float32 "
                "(keep a lower precision for compute with autocast, not in the parameters)"
            )
        params.append(ParamSpec(name, tuple(p.shape), _dtype_name(p.dtype)))
    if not params:
        raise TaskError("the model has no trainable parameters")
    return ModelSignature(tuple(params), train_size, buffers)


def running_buffers(model: nn.Module, before: dict[str, torch.Tensor]) -> tuple[ParamSpec, ...]:
    """The floating-point buffers that differ from `before` (taken before a training forward), in order.

    These are the buffers that travel. Integer buffers that a forward changes
    (`num_batches_tracked`) are counters, not estimates: each process keeps its own.
    """
    return tuple(
        ParamSpec(name, tuple(b.shape), _dtype_name(b.dtype))
        for name, b in model.named_buffers()
        if b.is_floating_point() and (name not in before or not torch.equal(before[name], b))
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


MAX_TRAVELLING_VALUES = 1 << 31  # 8 GiB of float32: beyond it a shard refuses to allocate a model


def signature_fields(sig: ModelSignature) -> dict[str, Any]:
    """The signature as INIT's fields."""
    return {
        "names": [p.name for p in sig.params],
        "shapes": [list(p.shape) for p in sig.params],
        "dtypes": [p.dtype for p in sig.params],
        "train_size": sig.train_size,
        "buffer_names": [b.name for b in sig.buffers],
        "buffer_shapes": [list(b.shape) for b in sig.buffers],
        "buffer_dtypes": [b.dtype for b in sig.buffers],
    }


def signature_from_fields(
    names: list[str],
    shapes: list[list[int]],
    dtypes: list[str],
    train_size: int,
    buffer_names: Sequence[str] = (),
    buffer_shapes: Sequence[Sequence[int]] = (),
    buffer_dtypes: Sequence[str] = (),
) -> ModelSignature:
    """A signature received from a peer; ValueError naming what is malformed or out of bounds.

    The buffer fields are optional: a signature without them (an older peer or
    checkpoint) is a model whose buffers do not travel.
    """
    params = _specs("parameter", names, shapes, dtypes, TRAVELLING_DTYPE_NAMES)
    if not params:
        raise ValueError("no parameters: a model has at least one trainable parameter")
    buffers = _specs("buffer", buffer_names, buffer_shapes, buffer_dtypes, BUFFER_DTYPE_NAMES)
    sig = ModelSignature(params, train_size, buffers)
    if train_size <= 0:
        raise ValueError(f"train_size {train_size}: a job trains on a non-empty dataset")
    if sig.total > MAX_TRAVELLING_VALUES:
        raise ValueError(f"{sig.total} parameters exceed the limit of {MAX_TRAVELLING_VALUES}")
    if sig.buffer_total > MAX_TRAVELLING_VALUES:
        raise ValueError(f"{sig.buffer_total} buffer values exceed the limit of {MAX_TRAVELLING_VALUES}")
    return sig


def _specs(
    what: str, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str], allowed: tuple[str, ...]
) -> tuple[ParamSpec, ...]:
    if not (len(names) == len(shapes) == len(dtypes)):
        raise ValueError(
            f"{len(names)} {what} names, {len(shapes)} shapes and {len(dtypes)} dtypes: one of each per {what}"
        )
    specs = []
    for name, shape, dtype in zip(names, shapes, dtypes, strict=True):
        if dtype not in allowed:
            raise ValueError(f"{what} {name}: dtype {dtype!r}; a {what} may be {', '.join(allowed)}")
        if len(shape) > 8 or any(d < 0 for d in shape):
            raise ValueError(f"{what} {name}: shape {shape} is not a tensor shape")
        specs.append(ParamSpec(name, tuple(shape), dtype))
    return tuple(specs)
