"""The job a shard serves, as the scheduler's WELCOME describes it, and what is fixed along with it.

A shard learns its job and its index only when the scheduler welcomes it; the
series it exports (labelled with that index), its checkpoint file, the bounds on
what a push may carry (push_bounds.py, gradient_bounds.py) and the layout of its
chunks all follow from them. They are made together, once, so the socket loop
(server.py) holds one object that is either there or not, never half of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from dynabatch.common.config import JobConfig, check_flags_against_task, job_from_dict
from dynabatch.common.protocols import protocol_settings
from dynabatch.common.wire.chunking import Chunk, make_layout
from dynabatch.common.wire.messages import ShardAssignment, Welcome
from dynabatch.common.wire.model_signature import ModelSignature
from dynabatch.optim import OptimizerSpec
from dynabatch.ps.checkpoint import load_checkpoint, save_checkpoint
from dynabatch.ps.gradient_bounds import GradientBounds
from dynabatch.ps.gradient_direction import GradientDirection
from dynabatch.ps.push_bounds import AssignedBatches, max_push_samples, push_steps
from dynabatch.ps.shard_metrics import ShardMetrics
from dynabatch.ps.shard_state import ShardState
from dynabatch.ps.step_size import StepSize
from dynabatch.ps.update_rules import optimizer_spec
from dynabatch.schedule import schedule_from_fields


@dataclass
class ServedJob:
    """The job's config, this shard's index, and what is made from them when the shard joins.

    `assigned` is each live worker's batch as the scheduler told it (push_bounds.py);
    `bounds` how far one push may move a chunk (gradient_bounds.py); `direction` which
    way it may point (gradient_direction.py); `max_samples` the most samples any push
    of this job can honestly carry.
    """

    job: JobConfig
    index: int
    metrics: ShardMetrics
    checkpoint_path: Path | None
    max_samples: int
    assigned: AssignedBatches
    bounds: GradientBounds
    direction: GradientDirection
    refused_protocol: str = ""  # the last protocol the scheduler ordered that this job cannot run here ("": none)

    @classmethod
    def welcomed(cls, welcome: Welcome, registry: CollectorRegistry, checkpoint_dir: str) -> ServedJob:
        """The job of `welcome`, its series on `registry`, its checkpoint in `checkpoint_dir` (empty: none)."""
        job = job_from_dict(welcome.config)
        index = welcome.shard_index
        max_samples = max_push_samples(job)
        return cls(
            job,
            index,
            ShardMetrics(registry, str(index)),
            Path(checkpoint_dir) / f"shard-{index}.pt" if checkpoint_dir else None,
            max_samples,
            AssignedBatches(push_steps(job), max_samples),
            GradientBounds(job.gradient_bound),
            GradientDirection(job.direction_check),
        )

    @property
    def name(self) -> str:
        """The job's name, which every message of it carries."""
        return self.job.job

    @property
    def label(self) -> str:
        """This shard's value of the `shard` label."""
        return str(self.index)

    def follow(self, assignment: ShardAssignment) -> bool:
        """The scheduler's latest live workers and their batches; True if a worker's bound grew, which the
        scheduler must hear before it hands that worker the larger batch (push_bounds.py)."""
        live = set(assignment.live_workers)
        self.metrics.live.set(len(live))
        self.bounds.forget(live)
        self.direction.forget(live)
        return self.assigned.update(assignment.batches)

    def switch(self, protocol: str, task_optimizer: OptimizerSpec | None = None) -> None:
        """Serve the job under `protocol` from now on (`--protocol auto`'s switch, which the scheduler's assignment
        orders): the bounds on a push follow it (a local round's delta sums its H steps). ConfigError, changing
        nothing, when the job's flags do not allow it, or the task names the shards' optimizer (`task_optimizer`),
        which a delta protocol's outer optimizer would silently replace."""
        job = replace(self.job, protocol=protocol)
        job.validate()
        check_flags_against_task(job, task_optimizer)
        self.job = job
        self.max_samples = max_push_samples(job)
        self.assigned.steps, self.assigned.job_max = push_steps(job), self.max_samples

    def defences_summary(self) -> str:
        """What the gradient bound and the direction check did in this job (the shard's closing line)."""
        bounds = self.bounds
        return (
            f"the gradient bound (--gradient-bound {bounds.factor:g}) clipped {bounds.clipped} pushes; "
            f"{len(bounds.quarantined)} workers quarantined; direction scores: {self.direction.summary()}"
        )

    @property
    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint must have been written for to be this shard's (checkpoint.py)."""
        job = self.job
        return {"job": job.job, "shard": self.index, "shards": job.shards, "chunk_bytes": job.chunk_bytes}

    def load_checkpoint(self) -> dict[str, Any] | None:
        """This shard's last checkpoint, or None if it keeps none or has none yet; raises ForeignCheckpoint if
        the file was written for another job or layout."""
        return load_checkpoint(self.checkpoint_path, self.checkpoint_meta) if self.checkpoint_path else None

    def save_checkpoint(self, fields: dict[str, Any]) -> None:
        """Write `fields` as this shard's checkpoint (the caller checks that it keeps one)."""
        assert self.checkpoint_path is not None, "this shard keeps no checkpoint"
        save_checkpoint(self.checkpoint_path, self.checkpoint_meta, fields)

    def chunks(self, sig: ModelSignature) -> list[Chunk]:
        """This shard's chunks of the model described by `sig`."""
        return make_layout(sig.total, self.job.chunk_bytes, self.job.shards).for_shard(self.index)

    def new_state(
        self, sig: ModelSignature, flat: torch.Tensor | None, optimizer: dict[str, Any], schedule: dict[str, Any]
    ) -> ShardState:
        """This shard's part of the model described by `sig`, at `flat` (None: zeros, a checkpoint follows),
        stepping with `optimizer` (an optimizer spec's fields; empty: the job's SGD flags) and `schedule` (a
        schedule's fields), both already checked by the caller or written by this shard into its checkpoint."""
        job = self.job
        return ShardState.initial(
            self.chunks(sig),
            torch.zeros(sig.total) if flat is None else flat,
            optimizer_spec(job, optimizer),
            job.protocol,
            job.global_batch,
            protocol_settings(job),
            [(p.name, math.prod(p.shape)) for p in sig.params],
            job.dbs_weight,
            StepSize(schedule_from_fields(schedule)),
            sig.train_size * job.epochs,
        )
