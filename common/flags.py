"""Command-line flags from config dataclasses, with environment defaults and validation.

Every field of a config dataclass becomes a flag (`global_batch` ->
`--global-batch`) whose default can come from the environment
(`DYNABATCH_GLOBAL_BATCH`), which is how containers are configured. Field
metadata carries the help text, allowed choices and lower bounds, so that a bad
value is refused with the flag's name before any process starts.

This is machinery only, with no settings of its own: the job's schema
(common/config.py) and each role's options use it, and so do `dynabatch keys` and
the transport's CURVE options, which must not load the job's schema.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "DYNABATCH_"

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A setting that cannot work, named by its flag."""


# The topics `--help` groups a command's flags by, in this order; each flag's own is its field's `topic`.
TOPICS = {
    "job": "job (what is trained, for how long, with which optimizer)",
    "protocol": "protocol (how workers and shards exchange updates, and each worker's batch)",
    "data": "data (where the training data comes from, how batches are loaded)",
    "cluster": "cluster (the processes, their endpoints, membership and resources)",
    "observability": "observability (logs, metrics, progress, reports)",
    "security": "security (encryption, authentication, limits on what peers may do)",
}


class FlagParser(argparse.ArgumentParser):
    """The parser of every dynabatch command: an error is one line of usage and the reason, and `--help`
    lists the flags grouped by topic (TOPICS), each flag's default once (in its help text, with its
    environment variable).

    argparse's own error message starts with the whole usage, 43 lines for `dynabatch run`, which
    pushed the one line that matters off the screen. Descriptions keep their line breaks. A prefix of a
    flag is refused, not taken for it: `--epoch 1` would otherwise set `--epochs` without a word, and a
    later flag sharing the prefix would silently change what an old command line means.
    """

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(
            prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
        )
        self.positional_names: list[str] = []
        # Made in TOPICS' order, up front: `--help` shows a group only once it holds a flag.
        self.topic_groups = {topic: self.add_argument_group(title) for topic, title in TOPICS.items()}

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings:
            self.positional_names.append(str(action.metavar or action.dest.upper()))
        return action

    def short_usage(self) -> str:
        """`usage: dynabatch export RUN_DIR [flags]   (--help lists them)`."""
        return f"usage: {' '.join([self.prog, *self.positional_names])} [flags]   (--help lists them)"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n")


def opt(
    default: Any,
    help: str,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    *,
    topic: str,
) -> Any:
    """A config field with its flag's help text, its `--help` topic (one of TOPICS) and validation bounds:
    at least `minimum`, or strictly more than `above` (for a setting whose zero means nothing: `--epochs 0`)."""
    if topic not in TOPICS:
        raise ValueError(f"topic {topic!r} is not one of {', '.join(TOPICS)}")
    meta = {"help": help, "choices": choices, "minimum": minimum, "above": above, "topic": topic}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def validate_fields(cfg: Any) -> None:
    """Check every field against its metadata (choices, minimum, above); every number must be finite.

    NaN compares false with everything, so a bound alone would let it through (`--epochs nan` trained for ever).
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag}: {value!r} is not one of {', '.join(map(str, choices))}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag}: {value} is not a finite number")
        minimum, above = f.metadata.get("minimum"), f.metadata.get("above")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{flag}: {value} is below the minimum {minimum}")
        if above is not None and not value > above:
            raise ConfigError(f"{flag}: {value} must be above {above:g}")


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
    """Add one flag per field of `cls`, defaulting to DYNABATCH_<FIELD> when set; a FlagParser files
    each under its field's topic."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        group = parser.topic_groups[f.metadata["topic"]] if isinstance(parser, FlagParser) else parser
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        env_name = ENV_PREFIX + f.name.upper()
        default = _default(cls, f)
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
            group.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"), help=help_text)


def _default(cls: type, f: dataclasses.Field[Any]) -> Any:
    """A flag's value when neither the command line nor the environment sets it; every flag has one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{cls.__name__}.{f.name} has no default: a flag needs one")


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build a `cls` from parsed flags (those added by `add_flags`)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
