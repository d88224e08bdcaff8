"""`dynabatch scheduler`: membership, speed model, batch sizes, job end."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from dynabatch.common.cli_support import CurveOptions, MetricsOptions, load_curve_keys, parse_role_args
from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.auto_protocol import resolved
from dynabatch.common.protocols import refuse_unread_settings
from dynabatch.scheduler.options import SchedulerOptions
from dynabatch.scheduler.server import SchedulerServer


def main(argv: Sequence[str]) -> int:
    opts, job, curve, metrics = parse_role_args(
        "dynabatch scheduler",
        "Run a job's scheduler; shards and workers join it.",
        [SchedulerOptions, JobConfig, CurveOptions, MetricsOptions],
        argv,
    )
    try:
        refuse_unread_settings(job)
        job, chosen = resolved(job)
    except ConfigError as exc:
        print(f"dynabatch scheduler: {exc}", file=sys.stderr)
        return 2
    if chosen:
        logging.getLogger("dynabatch.scheduler").info("protocol auto chose %s", chosen)
    keys = load_curve_keys("dynabatch scheduler", curve, "scheduler")
    try:
        server = SchedulerServer(job, opts, metrics.metrics_host, metrics.metrics_port, keys)
    except ValueError as exc:  # saved progress that does not parse or belongs to another job; a port taken
        print(f"dynabatch scheduler: {exc}", file=sys.stderr)
        return 2
    return server.run()
