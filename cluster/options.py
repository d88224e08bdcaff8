"""The settings of the commands `cluster` runs: `dynabatch run` (how many processes, where the run folder goes),
`dynabatch export` and `dynabatch check`.

The job's own settings are JobConfig's flags, passed through to the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dynabatch.cluster.metric_target import MetricTarget
from dynabatch.common.flags import ConfigError, opt, validate_fields
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.shared_options import ShardCheckpointOptions, TaskOptions, TrainingOptions, check_task_flag
from dynabatch.common.slowdown import Slowdown
from dynabatch.common.tasks.task_spec import anchored_task_spec


@dataclass
class RunOptions(TrainingOptions, ShardCheckpointOptions):
    """`dynabatch run`'s own settings; the workers' and shards' flags it forwards are theirs
    (common/shared_options.py)."""

    workers: int = opt(3, "training workers to start", minimum=1, topic="cluster")
    slowdowns: list[str] = opt(
        ["1", "2", "4"],
        "per-worker slowdown factors or schedules (one, or one per worker), e.g. 1 2 4 or 1x,4x@60s",
        topic="cluster",
    )
    evaluator: bool = opt(True, "start an evaluator that reports test accuracy", topic="cluster")
    out: str = opt("runs", "parent folder of the run folder", topic="observability")
    name: str = opt("", "run folder name (default: time-protocol-policy)", topic="observability")
    max_batches: list[int] = opt(
        [0],
        "per-worker largest batch, the memory of each machine (one, or one per worker; 0: none), e.g. 64 32 0",
        topic="cluster",
    )
    plots: bool = opt(
        True,
        "write the run folder's PNG plots when the run ends (about a second of CPU; the timeline "
        "they are drawn from is written either way)",
        topic="observability",
    )
    progress_s: float = opt(2.0, "seconds between progress lines", minimum=0.1, topic="observability")
    status_s: float = opt(0.5, "seconds between timeline samples", minimum=0.05, topic="observability")
    timeout_s: float = opt(3600.0, "abort the run after this long", minimum=1.0, topic="cluster")
    restarts: int = opt(
        3,
        "times a process that exits with an error is started again (a shard resumes from its "
        "checkpoint, the scheduler from its saved progress, a worker joins anew); past that a worker "
        "is left out while the job can go on without it, and any other process fails the run",
        minimum=0,
        topic="cluster",
    )
    warmup_fraction: float = opt(
        0.2, "fraction of the run left out of the summary's step-time means", minimum=0.0, topic="observability"
    )
    preloader: str = opt(
        "",
        "fork the shards and workers from the preloader listening at this socket (`dynabatch preload "
        "SOCKET`: torch imported once for many jobs) instead of one of the run's own",
        topic="cluster",
    )
    target_metric: str = opt(
        "",
        "report the time to the first evaluation meeting METRIC>=VALUE or METRIC<=VALUE "
        "(e.g. accuracy>=0.9, loss<=0.3; any metric of the task)",
        topic="observability",
    )

    def validate(self) -> None:
        TrainingOptions.validate(self)
        if self.name and (Path(self.name).name != self.name or self.name in (".", "..")):
            raise ConfigError(f"--name {self.name}: the run folder's name inside --out, without / or ..")
        if len(self.slowdowns) not in (1, self.workers):
            raise ConfigError(
                f"--slowdowns: {len(self.slowdowns)} given for {self.workers} workers (give 1 or {self.workers})"
            )
        if len(self.max_batches) not in (1, self.workers):
            raise ConfigError(
                f"--max-batches: {len(self.max_batches)} given for {self.workers} workers (give 1 or {self.workers})"
            )
        if any(b < 0 for b in self.max_batches):
            raise ConfigError(f"--max-batches: {self.max_batches} holds a negative batch (0: no limit)")
        for text in self.slowdowns:
            try:
                Slowdown.parse(text)
            except ValueError as exc:
                raise ConfigError(f"--slowdowns: {exc}") from None
        if self.warmup_fraction >= 1.0:
            raise ConfigError("--warmup-fraction must be below 1")
        if self.preloader and not Path(self.preloader).is_socket():
            raise ConfigError(f"--preloader {self.preloader}: no socket there (start one: dynabatch preload SOCKET)")
        self.target()

    def target(self) -> MetricTarget | None:
        """The parsed --target-metric (None when not given); ConfigError naming the flag if malformed."""
        if not self.target_metric:
            return None
        try:
            return MetricTarget.parse(self.target_metric)
        except ValueError as exc:
            raise ConfigError(f"--target-metric: {exc}") from None

    def anchored(self) -> RunOptions:
        """These options with the task's file, --data-dir and --init as absolute paths: the run folder's
        config.json then names them from any folder (`dynabatch export RUN` run elsewhere), and so do the
        command lines of the processes it starts."""
        return replace(
            self,
            task=anchored_task_spec(self.task),
            data_dir=str(Path(self.data_dir).expanduser().resolve()) if self.data_dir else "",
            init=str(Path(self.init).expanduser().resolve()) if self.init else "",
        )

    def slowdown_of(self, i: int) -> str:
        return self.slowdowns[0] if len(self.slowdowns) == 1 else self.slowdowns[i]

    def max_batch_of(self, i: int) -> int:
        return self.max_batches[0] if len(self.max_batches) == 1 else self.max_batches[i]


@dataclass
class ExportOptions:
    out: str = opt(
        "", "the state_dict file to write (required)", topic="job", env="DYNABATCH_EXPORT_OUT"
    )  # DYNABATCH_OUT is `dynabatch run`'s parent folder of run folders
    task: str = opt(
        "",
        "the task whose model receives the weights: FILE.py:ATTR or package.module:ATTR (default: the run's own task)",
        topic="job",
    )

    def validate(self) -> None:
        validate_fields(self)
        check_task_flag(self.task)
        if not self.out:
            raise ConfigError("--out: name the file to write, e.g. --out model.pt")


@dataclass
class CheckOptions(TaskOptions):
    """`dynabatch check`'s settings: the task, data and threads a worker would have, and what to time."""

    batches: list[int] = opt([16, 64], "batch sizes to time a training step at (two or more)", topic="observability")
    repeats: int = opt(5, "timed steps per batch size (the fastest is reported)", minimum=1, topic="observability")
    save_profile: str = opt(
        "",
        "add this machine's fitted step curve (and --device-max-batch) as one worker group "
        "to a cluster file, made if absent, for `dynabatch plan --profile FILE`",
        topic="observability",
    )
    link_mbit: float = opt(
        0.0,
        "with --save-profile: this machine's link to the shards in Mbit/s (check cannot measure it)",
        minimum=0,
        topic="observability",
    )
    device_max_batch: int = opt(
        0,
        "with --save-profile: the largest batch this machine's memory holds, as the "
        "worker's own --max-batch (0: none known)",
        minimum=0,
        topic="observability",
    )

    def validate(self) -> None:
        TaskOptions.validate(self)
        if self.save_profile and self.link_mbit <= 0:
            raise ConfigError(
                "--save-profile needs --link-mbit: this machine's link to the shards, in Mbit/s "
                "(e.g. 1000 for 1 Gbit Ethernet)"
            )
        if not self.save_profile and (self.link_mbit or self.device_max_batch):
            flag = "--link-mbit" if self.link_mbit else "--device-max-batch"
            raise ConfigError(f"{flag}: only --save-profile FILE.json records it; give that too, or drop it")
        if len(set(self.batches)) < 2 or min(self.batches) < 1:
            raise ConfigError(f"--batches {' '.join(map(str, self.batches))}: two or more different sizes, each >= 1")


@dataclass
class PlanOptions:
    """`dynabatch plan`'s settings: where the measured cluster is and the task's K(B); the job it would run is the
    job flags' (--global-batch where set or the cluster names none, --model where a file names no model_bytes,
    --chunk-bytes where it is a file)."""

    profile: str = opt(
        "",
        "a cluster file (the format of common/planning/cluster_file.py; `dynabatch check --save-profile` "
        "writes one), instead of a run folder",
        topic="job",
    )
    json: bool = opt(False, "print the predictions and the choice as JSON", topic="observability")
    plot: str = opt(
        "",
        "the plot's PNG file (default: plan.png in the run folder, or FILE.plan.png beside the cluster file)",
        topic="observability",
    )
    k_min: float = opt(
        STUDY_NOISE.k_min,
        "K_min of the task's K(B) = K_min (1 + B_noise / B) (default: the "
        "study's MLP on Fashion-MNIST to 80 percent accuracy)",
        above=0,
        topic="job",
    )
    b_noise: float = opt(STUDY_NOISE.b_noise, "B_noise of the task's K(B)", minimum=0, topic="job")

    def validate(self) -> None:
        validate_fields(self)
