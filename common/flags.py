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
from collections.abc import Collection, Iterable, Mapping, Sequence
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
        # The config fields add_flags made flags of, and those whose default it took from the environment
        # (given, as a flag on the command line is).
        self.field_flags: set[str] = set()
        self.env_given: set[str] = set()
        # Made in TOPICS' order, up front: `--help` shows a group only once it holds a flag.
        self.topic_groups = {topic: self.add_argument_group(title) for topic, title in TOPICS.items()}

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings:
            self.positional_names.append(str(action.metavar or action.dest.upper()))
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse as argparse does, and record in `flags_given` (see `given`) the fields whose flags were set on
        the command line or by the environment.

        argparse sets a default without a trace, so a flag set to its default value cannot otherwise be told from
        one left alone. The command line is parsed a second time into a namespace that already holds a marker for
        every field's flag, where argparse leaves their defaults out: what still holds the marker was not given.
        (A field's flag only stores what it parses, so the marker is never read.) The first parse has already
        refused what is malformed, so the second cannot fail.
        """
        parsed, extras = super().parse_known_args(args, namespace)
        unset = object()
        probe = argparse.Namespace(**dict.fromkeys(self.field_flags, unset))
        super().parse_known_args(args, probe)
        parsed.flags_given = frozenset(self.env_given | {f for f in self.field_flags if getattr(probe, f) is not unset})
        return parsed, extras

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
    below: float | None = None,
    env: str = "",
) -> Any:
    """A config field with its flag's help text, its `--help` topic (one of TOPICS) and validation bounds:
    at least `minimum`, or strictly more than `above` (for a setting whose zero means nothing: `--epochs 0`), and
    strictly less than `below` (a momentum of 1 never forgets). `env` names its environment variable where
    DYNABATCH_<FIELD> would be another command's same-named flag of another meaning."""
    if topic not in TOPICS:
        raise ValueError(f"topic {topic!r} is not one of {', '.join(TOPICS)}")
    meta = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "above": above,
        "below": below,
        "topic": topic,
        "env": env,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def validate_fields(cfg: Any) -> None:
    """Check every field against its metadata (choices, minimum, above, below); every number must be finite.

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
        below = f.metadata.get("below")
        if below is not None and not value < below:
            raise ConfigError(f"{flag}: {value} must be below {below:g}")


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


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    env: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> None:
    """Add one flag per field of `cls` (or per field named in `only`: a command that reads a few of a schema's
    settings takes those alone, so that its `--help` lists what it uses and a flag it would ignore is refused),
    defaulting to DYNABATCH_<FIELD> when set; a FlagParser files each under its field's topic and records the
    fields the environment set."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        group = parser.topic_groups[f.metadata["topic"]] if isinstance(parser, FlagParser) else parser
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        env_name = env_variable(f)
        default = _default(cls, f)
        if env_name in env:
            try:
                default = _parse_value(kind, env[env_name])
            except ValueError as exc:
                parser.error(f"{env_name}={env[env_name]!r}: {exc}")
        if isinstance(parser, FlagParser):
            parser.field_flags.add(f.name)
            if env_name in env:
                parser.env_given.add(f.name)
        help_text = f"{f.metadata.get('help', '')} [env {env_name}; default {default!r}]"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            group.add_argument(flag, nargs="+", type=item, default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"), help=help_text)


def env_variable(f: dataclasses.Field[Any]) -> str:
    """The environment variable that sets field `f`'s flag: DYNABATCH_<FIELD>, or the one its `opt` names."""
    return str(f.metadata.get("env") or ENV_PREFIX + f.name.upper())


def _default(cls: type, f: dataclasses.Field[Any]) -> Any:
    """A flag's value when neither the command line nor the environment sets it; every flag has one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{cls.__name__}.{f.name} has no default: a flag needs one")


def changed(config: Any, names: Iterable[str]) -> list[str]:
    """Those of `names` whose value in the dataclass `config` is not its field's default: all that a process handed
    a config (a worker sent the job) can tell of the flags set, so the rules that refuse a setting given beside
    another read it so wherever they run."""
    defaults = {f.name: _default(type(config), f) for f in dataclasses.fields(config)}
    return [name for name in names if getattr(config, name) != defaults[name]]


def typed_values(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The values in `data` for `cls`'s fields (others ignored), each of its field's type: an int taken for a float,
    a list or tuple for a list (its items so too); ConfigError naming the first that is not, as `where` calls it
    ("job setting": a job received on the wire; "db.run": a keyword argument). A bool is no number, a string no
    list (`slowdowns="12"` would have been two workers' factors)."""
    hints = typing.get_type_hints(cls)

    def of(kind: Any, value: Any) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typing.get_origin(kind) is list and isinstance(value, (list, tuple)):
            (item,) = typing.get_args(kind)
            return [of(item, v) for v in value]
        if typing.get_origin(kind) is list or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError
        return value

    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kind = hints[f.name]
            try:
                values[f.name] = of(kind, data[f.name])
            except TypeError:
                name = str(kind) if typing.get_origin(kind) else kind.__name__
                raise ConfigError(f"{where} {f.name}={data[f.name]!r} is not {name}") from None
    return values


def from_args(cls: type[T], args: argparse.Namespace, only: Collection[str] | None = None) -> T:
    """Build a `cls` from parsed flags (those added by `add_flags`, with the same `only`); a field left out of
    `only` keeps its default."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if only is None or f.name in only})


def given(args: argparse.Namespace, name: str) -> bool:
    """Whether the flag of field `name` was set on the command line or by the environment (a FlagParser's
    parse), even to its default value: where a setting in a file gives way to a flag, only a flag that was
    given should win."""
    return name in args.flags_given
