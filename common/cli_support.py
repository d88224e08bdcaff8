"""What every role's command line shares: flag parsing with validation, logging."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from dynabatch.common.config import MetricsOptions
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.common.net.curve import CurveKeyError, CurveKeys, CurveOptions
from dynabatch.common.net.metrics import ADDRESS_LOG


def parse_role_args(prog: str, description: str, classes: Sequence[type], argv: Sequence[str]) -> list[Any]:
    """Parse `argv` into one validated instance per config class; bad values exit 2 naming the flag."""
    parser = FlagParser(prog, description)
    parser.topic_groups["observability"].add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="what the log shows [default 'INFO']",
    )
    for cls in classes:
        add_flags(parser, cls)
    args = parser.parse_args(argv)
    configs: list[Any] = [from_args(cls, args) for cls in classes]
    try:
        for cfg in configs:
            if hasattr(cfg, "validate"):
                cfg.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level)
    return configs


def load_curve_keys(prog: str, curve: CurveOptions, role: str) -> CurveKeys | None:
    """The keys in --curve-dir (None when it is empty); a missing or unreadable file exits 2 naming it.

    Checked here, at startup, rather than when the first socket opens, so that a
    bad Secret mount is a clear one-line error and not a traceback in a restart loop.
    """
    if not curve.curve_dir:
        return None
    try:
        return CurveKeys.load(curve.curve_dir, role)
    except CurveKeyError as exc:
        print(f"{prog}: error: --curve-dir: {exc}", file=sys.stderr)
        sys.exit(2)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    ADDRESS_LOG.setLevel(logging.INFO)


__all__ = ["CurveOptions", "MetricsOptions", "load_curve_keys", "parse_role_args", "setup_logging"]
