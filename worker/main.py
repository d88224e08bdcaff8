"""`dynabatch worker`: a training worker, or with --evaluator an evaluator.

Its flags and keys are checked before the training code is imported: that code
imports torch (about 1.5 s of CPU), and `--help` or a mistyped flag answers at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dynabatch.common.cli_support import CurveOptions, MetricsOptions, load_curve_keys, parse_role_args
from dynabatch.common.flags import ConfigError
from dynabatch.common.net.curve import CurveKeys
from dynabatch.common.tasks.dataset_files import BadDatasetFile, DatasetNotFound
from dynabatch.common.wire.messages import Role
from dynabatch.task_error import TaskError
from dynabatch.worker.options import WorkerOptions


def main(argv: Sequence[str]) -> int:
    opts, curve, metrics = parse_role_args(
        "dynabatch worker",
        "Join a running job as a training worker (or --evaluator).",
        [WorkerOptions, CurveOptions, MetricsOptions],
        argv,
    )
    keys = load_curve_keys("dynabatch worker", curve, "evaluator" if opts.evaluator else "worker")
    return serve(opts, metrics, keys)


def serve(opts: WorkerOptions, metrics: MetricsOptions, keys: CurveKeys | None) -> int:
    """Train (or evaluate) until the job ends; exit 2 with one line for what the user must fix, 1 with one line
    where the scheduler refused its start-up report (`NeverAdmitted`: started again, a restart probes anew)."""
    from dynabatch.worker.device import usable_device
    from dynabatch.worker.evaluator import Evaluator
    from dynabatch.worker.heartbeats import NeverAdmitted
    from dynabatch.worker.role_process import RoleProcess
    from dynabatch.worker.trainer import Worker

    try:
        usable_device(opts.device)
    except ConfigError as exc:
        print(f"dynabatch worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        process = RoleProcess(
            opts, Role.EVALUATOR if opts.evaluator else Role.WORKER, metrics.metrics_host, metrics.metrics_port, keys
        )
        if opts.evaluator:
            return process.serve(lambda joined: Evaluator(opts, process, joined).run())
        return process.serve(lambda joined: Worker(opts, process, joined).train())
    except (DatasetNotFound, BadDatasetFile, TaskError, ConfigError) as exc:
        print(f"dynabatch worker: {exc}", file=sys.stderr)  # the line `dynabatch run` ends the run with
        return 2
    except NeverAdmitted as exc:
        print(f"dynabatch worker: error: {exc}", file=sys.stderr)
        return 1
