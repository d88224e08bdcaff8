"""`dynabatch check --task T`: an offline dry run of a task, before any job starts.

Builds the model twice under the job's seed (same initial parameters?), lists the
trainable parameters, their bytes and the chunk layout for --chunk-bytes and
--shards, the frozen parameters and buffers with what happens to them, times a
training step at two or more batch sizes, fits t(b) = a + c*b and prints the
bytes a worker moves per step. A task that cannot train exits 2 naming why.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dynabatch.cluster.options import CheckOptions
from dynabatch.common.config import JobConfig, check_flags_against_task
from dynabatch.common.dataset_files import BadDatasetFile, DatasetNotFound
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.task_error import TaskError


def main(argv: Sequence[str]) -> int:
    parser = FlagParser("dynabatch check", __doc__)
    add_flags(parser, CheckOptions)
    add_flags(parser, JobConfig)
    args = parser.parse_args(argv)
    opts, job = from_args(CheckOptions, args), from_args(JobConfig, args)
    try:
        opts.validate()
        job.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    # Imported once the flags are known good: they bring in torch (seconds), which a bad flag need not wait for.
    import torch

    from dynabatch.cluster.dry_run import dry_run, format_dry_run
    from dynabatch.common.builtin_tasks import builtin_task
    from dynabatch.common.task_check import load_task

    torch.set_num_threads(opts.threads)
    try:
        task = load_task(opts.task) if opts.task else builtin_task(job.dataset, job.model, opts.data_dir or None)
        check_flags_against_task(job, task.optimizer)
        report = dry_run(task, job, opts.batches, opts.repeats)
    except (DatasetNotFound, BadDatasetFile, TaskError, ConfigError) as exc:
        print(f"dynabatch check: {exc}", file=sys.stderr)
        return 2
    print(format_dry_run(report, job, opts.task or task.name))
    return 0
