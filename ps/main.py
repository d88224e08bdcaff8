"""`dynabatch ps`: one parameter-server shard.

Its flags and keys are checked before the shard's code is imported: that code
imports torch (seconds of CPU), and `--help` or a mistyped flag answers at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dynabatch.common.cli_support import CurveOptions, MetricsOptions, load_curve_keys, parse_role_args
from dynabatch.common.flags import ConfigError
from dynabatch.ps.options import PsOptions


def main(argv: Sequence[str]) -> int:
    opts, curve, metrics = parse_role_args(
        "dynabatch ps",
        "Serve a parameter-server shard; the job's settings come from the scheduler.",
        [PsOptions, CurveOptions, MetricsOptions],
        argv,
    )
    keys = load_curve_keys("dynabatch ps", curve, "ps")
    from dynabatch.ps.server import ShardServer

    try:
        server = ShardServer(opts, metrics.metrics_host, metrics.metrics_port, keys)
    except ConfigError as exc:  # a port taken
        print(f"dynabatch ps: {exc}", file=sys.stderr)
        return 2
    return server.run()
