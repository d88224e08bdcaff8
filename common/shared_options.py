"""Settings that two commands share, each defined once here and inherited by both commands' options.

`dynabatch run` starts the other roles and hands them its flags: a worker's task, data and compute
settings, a shard's checkpoint cadence. A shard and a worker find their job the same way (the job's
name is JobName's, common/config.py). A flag with one meaning has one definition, so its help,
default and bounds cannot drift apart between the command that takes it and the command it is
forwarded to (tests/test_cli.py holds every option module to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.config import JobName
from dynabatch.common.flags import ConfigError, opt, validate_fields
from dynabatch.common.net.endpoint import check_endpoint
from dynabatch.common.net.metrics import ON_FINISH
from dynabatch.common.tasks.task_spec import split_task_spec
from dynabatch.common.wire.member_name import name_problem
from dynabatch.task_error import TaskError


def check_task_flag(spec: str) -> None:
    """A --task that is not FILE.py:ATTR or package.module:ATTR is a bad flag, refused before torch is imported."""
    if spec:
        try:
            split_task_spec(spec)
        except TaskError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class TaskOptions:
    """What a worker trains and on how many threads: `dynabatch worker`, `run` and `check` take these alike."""

    task: str = opt(
        "",
        "what to train: FILE.py:ATTR or package.module:ATTR naming a dynabatch.Task "
        "(default: the job's --model on its --dataset)",
        topic="job",
    )
    data_dir: str = opt(
        "", "folder with the built-in datasets' files (default: search the standard places)", topic="data"
    )
    threads: int = opt(1, "torch threads of each worker's compute", minimum=1, topic="cluster")

    def validate(self) -> None:
        validate_fields(self)
        check_task_flag(self.task)


@dataclass
class TrainingOptions(TaskOptions):
    """How each worker trains its task: `dynabatch worker`'s flags, which `dynabatch run` forwards to its workers."""

    init: str = opt(
        "",
        "start from these weights: a state_dict file (torch.save, dynabatch export) loaded into "
        "each worker's and the evaluator's model; the worker that initialises the shards sends them, "
        "and frozen parameters and buffers come from it on every worker",
        topic="job",
    )
    micro_batch: int = opt(
        0,
        "workers run an assigned batch as passes of at most this many samples, accumulating "
        "their gradients (0: one pass); not with the job's --pipeline on",
        minimum=0,
        topic="data",
    )
    loader_workers: int = opt(
        0,
        "processes loading batches ahead for each worker (a torch DataLoader whose batch "
        "sampler follows the assigned batch size); 0: load in the worker's own process",
        minimum=0,
        topic="data",
    )


@dataclass
class MemberOptions(JobName):
    """How a shard or a worker finds its job (its --job and scheduler) and what it does once the job ends."""

    scheduler: str = opt("tcp://127.0.0.1:5555", "scheduler control endpoint", topic="cluster")
    name: str = opt(
        "",
        "name in logs and dashboards (default: ps-HOSTNAME for a shard, HOSTNAME-PID for a worker)",
        topic="observability",
    )
    on_finish: str = opt(
        "exit",
        "when the job ends: exit, or idle serving /healthz until stopped (Kubernetes)",
        ON_FINISH,
        topic="cluster",
    )

    def validate(self) -> None:
        validate_fields(self)
        check_endpoint("--scheduler", self.scheduler)
        problem = name_problem(self.name)
        if problem:
            raise ConfigError(f"--name: {problem}")


@dataclass
class ShardCheckpointOptions:
    """How often a shard checkpoints: `dynabatch ps`'s flag, which `dynabatch run` forwards to its shards."""

    checkpoint_interval_s: float = opt(30.0, "seconds between shard checkpoints", minimum=0.1, topic="cluster")
