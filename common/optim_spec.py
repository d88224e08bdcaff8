"""The shard optimizer a task asks for, as plain data that can travel to the shards.

Shards run no user code: a task names its optimizer with one of these specs,
the first worker sends the spec's fields with the model's signature, and the
shards build the optimizer from them. Shards apply SGD today (with DBS-SGD's
per-gradient weighting); Adam and AdamW are accepted in a task and refused at
start-up with a clear error until the shards implement them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ON_SHARDS = ("sgd",)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's name and hyperparameters; `no_decay` lists parameter-name substrings without weight decay."""

    name: str
    lr: float
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = field(default_factory=tuple)

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["no_decay"] = list(self.no_decay)
        return out


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    name: str = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class AdamW(OptimizerSpec):
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
