"""The shard optimizer a task asks for, as plain data that can travel to the shards.

Shards run no user code: a task names its optimizer with one of these specs,
the first worker sends the spec's fields with the model's signature, and the
shards build the optimizer from them (ps/update_rules.py). A spec that arrives
from a peer is checked field by field here (`optimizer_from_fields`) before a
shard builds anything from it; a task's own spec goes through the same check at
start-up, so a bad one fails before a job starts.

`dynabatch.optim`: what `__all__` names is the promise to users; the wire form's
parser (`optimizer_from_fields`) is the shards' and stays beside the specs it builds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["OptimizerSpec", "SGD", "Adam", "AdamW"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An optimizer's name and hyperparameters; `no_decay` lists parameter-name substrings without weight decay.

    Keyword-only (`SGD(lr=0.1)`: `SGD(0.1)` would have named the optimizer 0.1), and checked as it is made, as the
    shards check what arrives (`optimizer_from_fields`), so that a value that cannot train is refused where it is
    written."""

    name: str
    lr: float
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _checked(self.to_wire())

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["no_decay"] = list(self.no_decay)
        return out


@dataclass(frozen=True, kw_only=True)
class SGD(OptimizerSpec):
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True, kw_only=True)
class Adam(OptimizerSpec):
    name: str = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class AdamW(Adam):
    """Adam with decoupled weight decay: the same hyperparameters, decay on by default."""

    name: str = "adamw"
    weight_decay: float = 0.01


SPECS: dict[str, type[OptimizerSpec]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
SUPPORTED_ON_SHARDS = tuple(SPECS)


def _rate(spec: str, key: str, value: Any) -> float:
    """A finite, non-negative number (bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"optimizer {spec}: {key} must be a finite non-negative number, got {value!r}")
    return float(value)


def optimizer_from_fields(fields_: dict[str, Any]) -> OptimizerSpec:
    """A spec from its wire fields (`to_wire`); ValueError naming the first malformed field.

    Unknown names and unknown fields are refused rather than ignored: a field the
    shards would drop silently (an Adam spec with `momentum`) is a task that
    does not train as written. Missing fields take the spec's defaults.
    """
    cls, values = _checked(fields_)
    return cls(**values)


def _checked(fields_: dict[str, Any]) -> tuple[type[OptimizerSpec], dict[str, Any]]:
    """The spec's class and its fields' values as `optimizer_from_fields` takes them; ValueError naming the first
    malformed field."""
    if not isinstance(fields_, dict):
        raise ValueError(f"an optimizer spec is a map of fields, got {type(fields_).__name__}")
    name = fields_.get("name")
    if name not in SPECS:
        raise ValueError(
            f"optimizer {name!r} is not applied by the shards (they apply {', '.join(SUPPORTED_ON_SHARDS)})"
        )
    cls = SPECS[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(fields_) - known)
    if unknown:
        raise ValueError(f"optimizer {name}: unknown fields {unknown} (it takes {sorted(known - {'name'})})")
    values: dict[str, Any] = {}
    for key, value in fields_.items():
        if key in ("lr", "weight_decay", "momentum"):
            values[key] = _rate(name, key, value)
            if key == "momentum" and values[key] >= 1:
                raise ValueError(f"optimizer {name}: momentum must lie in [0, 1), got {value!r}")
        elif key == "eps":
            values[key] = _rate(name, key, value)
            if values[key] == 0:
                raise ValueError(f"optimizer {name}: eps must be positive (it keeps an unused parameter's step 0/eps)")
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"optimizer {name}: betas must be two numbers, got {value!r}")
            betas = tuple(_rate(name, key, b) for b in value)
            if not all(b < 1 for b in betas):
                raise ValueError(f"optimizer {name}: betas must lie in [0, 1), got {list(betas)}")
            values[key] = betas
        elif key == "nesterov":
            if not isinstance(value, bool):
                raise ValueError(f"optimizer {name}: nesterov must be true or false, got {value!r}")
            values[key] = value
        elif key == "no_decay":
            if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
                raise ValueError(
                    f"optimizer {name}: no_decay must be a list of non-empty name substrings, got {value!r}"
                )
            values[key] = tuple(value)
    return cls, values
