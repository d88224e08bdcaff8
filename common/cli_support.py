"""What every role's command line shares: flag parsing with validation, logging."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from dynabatch.common.config import ConfigError, MetricsOptions, add_flags, from_args


def parse_role_args(prog: str, description: str, classes: Sequence[type], argv: Sequence[str]) -> list[Any]:
    """Parse `argv` into one validated instance per config class; bad values exit 2 naming the flag."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    for cls in classes:
        add_flags(parser, cls)
    args = parser.parse_args(argv)
    configs = [from_args(cls, args) for cls in classes]
    try:
        for cfg in configs:
            if hasattr(cfg, "validate"):
                cfg.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level)
    return configs


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )


__all__ = ["MetricsOptions", "parse_role_args", "setup_logging"]
