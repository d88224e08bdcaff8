"""Configuration dataclasses and their command-line flags.

Every field of a config dataclass becomes a flag (`global_batch` ->
`--global-batch`) whose default can come from the environment
(`DYNABATCH_GLOBAL_BATCH`), which is how containers are configured. Field
metadata carries the help text, allowed choices and lower bounds, so that a bad
value is refused with the flag's name before any process starts.

The job's settings (`JobConfig`) live with the scheduler only: workers and
shards receive them in WELCOME, so a job is configured in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from dynabatch.common.data import DATASETS
from dynabatch.common.models import MODELS
from dynabatch.common.protocols import PROTOCOLS

ENV_PREFIX = "DYNABATCH_"
BATCH_POLICIES = ("fixed", "dynamic")

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting that cannot work, named by its flag."""


def opt(default: Any, help: str, choices: tuple[Any, ...] | None = None, minimum: float | None = None) -> Any:
    """A config field with its flag's help text and validation bounds."""
    meta = {"help": help, "choices": choices, "minimum": minimum}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobConfig:
    """What is trained and how: set on the scheduler, sent to every process."""

    job: str = opt("dynabatch", "job name; messages of other jobs are refused")
    dataset: str = opt("fashion-mnist", "training data", DATASETS)
    model: str = opt("cnn", "model architecture", MODELS)
    protocol: str = opt("asgd", "parameter-server update protocol", PROTOCOLS)
    batch_policy: str = opt(
        "dynamic", "fixed: B/n per worker; dynamic: sized by measured speed (DBS-SGD)", BATCH_POLICIES
    )
    flat_params: int = opt(1_000_000, "parameters of the 'flat' model (transport benchmarks)", minimum=10)
    shards: int = opt(1, "number of parameter-server shards", minimum=1)
    min_workers: int = opt(1, "hand out batches only once this many workers have joined (then keep going with fewer)", minimum=1)
    global_batch: int = opt(192, "reference global batch B, split across workers", minimum=1)
    min_batch: int = opt(8, "smallest per-worker batch", minimum=1)
    max_batch: int = opt(1024, "largest per-worker batch", minimum=1)
    lr: float = opt(0.05, "base learning rate for a global batch of B", minimum=0.0)
    momentum: float = opt(
        0.5, "SGD momentum on the shards (asynchrony adds implicit momentum, so asgd wants less than 0.9)", minimum=0.0
    )
    weight_decay: float = opt(1e-4, "SGD weight decay on the shards", minimum=0.0)
    nesterov: bool = opt(False, "Nesterov momentum on the shards")
    epochs: float = opt(8.0, "stop after this many passes over the training set (counted from samples)", minimum=0.0)
    time_budget_s: float = opt(
        0.0, "also stop this many seconds after training began (0: no limit); benchmarks compare runs at equal time",
        minimum=0.0,
    )
    pipeline: bool = opt(
        False, "overlap pulls with forward and pushes with backward, chunk by chunk (gradient protocols; experimental)"
    )
    max_inflight_bytes: int = opt(8 << 20, "credit: gradient bytes a worker may have pushed but not yet acknowledged", minimum=1024)
    chunk_bytes: int = opt(1 << 20, "target size of a parameter chunk in bytes", minimum=1024)
    seed: int = opt(0, "seed for model init and data orders")
    heartbeat_s: float = opt(0.5, "seconds between heartbeats", minimum=0.01)
    liveness_timeout_s: float = opt(5.0, "drop a process whose heartbeats stop for this long", minimum=0.1)
    join_timeout_s: float = opt(
        120.0, "drop a process that registered but sent no heartbeat (it loads data and measures itself first)",
        minimum=0.1,
    )
    reassign_threshold: float = opt(
        0.1, "hysteresis: reassign only if some batch changes by more than this fraction", minimum=0.0
    )
    softsync_n: int = opt(1, "softsync: update after floor(workers / n) gradients", minimum=1)
    staleness: int = opt(
        3, "ssp: a worker's pull waits while it is more than this many steps ahead of the slowest live worker "
        "(0: lock-step like ssgd; large: asgd)", minimum=0,
    )
    local_steps: int = opt(8, "local: local steps between syncs; msd: the most local steps (AdaComm's H0)", minimum=1)
    outer_lr: float = opt(1.0, "local/msd: outer learning rate on the averaged delta (1: plain averaging)", minimum=0.0)
    outer_momentum: float = opt(0.0, "local/msd: outer momentum (DiLoCo: 0.9 with --outer-lr 0.7)", minimum=0.0)
    outer_nesterov: bool = opt(True, "local/msd: Nesterov form of the outer momentum")
    round_timeout_s: float = opt(10.0, "ssgd: close a round without workers that have not pushed by then", minimum=0.1)
    eval_interval_s: float = opt(10.0, "seconds between evaluations of the current model", minimum=0.1)
    await_final_eval: bool = opt(
        False, "finish only once an evaluator has evaluated the final model; with none connected, wait up to "
        "--join-timeout-s for one (dynabatch run sets it when it starts an evaluator)",
    )
    speed_window: int = opt(16, "step-time observations kept per worker", minimum=2)
    speed_forgetting: float = opt(0.85, "weight of an observation one step older (0-1)", minimum=0.0)

    def validate(self) -> None:
        validate_fields(self)
        if self.min_batch > self.max_batch:
            raise ConfigError(f"--min-batch {self.min_batch} is larger than --max-batch {self.max_batch}")
        if not 0.0 < self.speed_forgetting <= 1.0:
            raise ConfigError("--speed-forgetting must be in (0, 1]")


@dataclass
class MetricsOptions:
    """Where a process serves /metrics and /healthz."""

    metrics_host: str = opt("0.0.0.0", "address for the /metrics and /healthz HTTP server")
    metrics_port: int = opt(0, "port for /metrics and /healthz (0: any free port)", minimum=0)


def validate_fields(cfg: Any) -> None:
    """Check every field against its metadata (choices, minimum)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag}: {value!r} is not one of {', '.join(map(str, choices))}")
        minimum = f.metadata.get("minimum")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{flag}: {value} is below the minimum {minimum}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean")


def _parse_value(kind: Any, text: str) -> Any:
    if kind is bool:
        return _parse_bool(text)
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return [item(part) for part in text.split()]
    return kind(text)


def add_flags(parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str] | None = None) -> None:
    """Add one flag per field of `cls`, defaulting to DYNABATCH_<FIELD> when set."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        env_name = ENV_PREFIX + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if env_name in env:
            try:
                default = _parse_value(kind, env[env_name])
            except ValueError as exc:
                parser.error(f"{env_name}={env[env_name]!r}: {exc}")
        help_text = f"{f.metadata.get('help', '')} [env {env_name}; default {default!r}]"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            group.add_argument(flag, nargs="+", type=item, default=default, help=help_text)
        else:
            group.add_argument(
                flag, type=kind, default=default, choices=f.metadata.get("choices"), help=help_text
            )


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build a `cls` from parsed flags (those added by `add_flags`)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict for the wire (WELCOME carries the JobConfig this way)."""
    return dataclasses.asdict(cfg)


def job_from_dict(data: Mapping[str, Any]) -> JobConfig:
    """Rebuild and validate a JobConfig received on the wire; unknown keys are ignored."""
    hints = typing.get_type_hints(JobConfig)
    values = {}
    for f in dataclasses.fields(JobConfig):
        if f.name in data:
            value = data[f.name]
            kind = hints[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"job setting {f.name}={value!r} is not {kind.__name__}")
            values[f.name] = value
    cfg = JobConfig(**values)
    cfg.validate()
    return cfg
