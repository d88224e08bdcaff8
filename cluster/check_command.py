"""`dynabatch check --task T`: an offline dry run of a task, before any job starts.

Builds the model twice under the job's seed (same initial parameters?), lists the
trainable parameters, their bytes and the chunk layout for --chunk-bytes and
--shards, the frozen parameters and buffers with what happens to them, times a
training step at two or more batch sizes, fits t(b) = a + c*b and prints the
bytes a worker moves per step. A task that cannot train exits 2 naming why.
`--save-profile FILE.json` adds this machine's fitted curve as one worker group to a
cluster file (common/planning/cluster_file.py), so that several machines' probes gather into
one file for `dynabatch plan --profile FILE.json`.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

from dynabatch.cluster.options import CheckOptions
from dynabatch.common.config import JobConfig, check_flags_against_task
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.common.planning.cluster_file import ClusterFileError, add_group
from dynabatch.common.tasks.dataset_files import BadDatasetFile, DatasetNotFound
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
    from dynabatch.common.tasks.builtin_tasks import builtin_task
    from dynabatch.common.tasks.task_check import load_task

    torch.set_num_threads(opts.threads)
    try:
        task = load_task(opts.task) if opts.task else builtin_task(job.dataset, job.model, opts.data_dir or None)
        check_flags_against_task(job, task.optimizer)
        report = dry_run(task, job, opts.batches, opts.repeats)
    except (DatasetNotFound, BadDatasetFile, TaskError, ConfigError) as exc:
        print(f"dynabatch check: {exc}", file=sys.stderr)
        return 2
    print(format_dry_run(report, job, opts.task or task.name))
    if opts.save_profile:
        return save_profile(opts, job, report.fixed_s, report.per_sample_s, report.param_bytes)
    return 0


def save_profile(opts: CheckOptions, job: JobConfig, fixed_s: float, per_sample_s: float, model_bytes: int) -> int:
    """Add this machine as one worker group to the cluster file --save-profile names (exit 2 where it cannot)."""
    if per_sample_s <= 0:
        print(
            "dynabatch check: --save-profile: the per-sample cost was not resolved at these batch sizes (try "
            "larger --batches); nothing written",
            file=sys.stderr,
        )
        return 2
    group = {
        "count": 1,
        "fixed_s": max(0.0, fixed_s),
        "per_sample_s": per_sample_s,
        "max_batch": opts.device_max_batch,
        "link_mbit": opts.link_mbit,
        "name": socket.gethostname(),
    }
    try:
        cluster = add_group(opts.save_profile, group, {"model_bytes": model_bytes, "global_batch": job.global_batch})
    except (ClusterFileError, OSError) as exc:
        print(f"dynabatch check: --save-profile: {exc}; nothing written", file=sys.stderr)
        return 2
    print(f"added this machine to {opts.save_profile}: {len(cluster.workers())} worker(s) in it now")
    return 0
