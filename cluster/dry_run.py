"""`dynabatch check`'s dry run: what a job would move and compute for a task, without starting one.

Everything here happens in this process: the task's start-up check (the model
built twice under the job's seed, the data, the loss), the trainable parameters
and the chunk layout the shards would hold, the state that never travels
(frozen parameters, buffers) with what happens to it, and forward/backward
timed at a few batch sizes and fitted as t(b) = a + c*b, the step-time model
the scheduler sizes batches with. The scheduler's own fitting (sliding window,
forgetting) lives in a role `cluster` may not import, and a dry run has one
clean measurement per batch size, so a least-squares line is all it needs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynabatch.common.config import JobConfig
from dynabatch.common.planning.line_fit import fit_line
from dynabatch.common.tasks.task_check import check_task
from dynabatch.common.wire.chunking import FLOAT_BYTES, Layout, make_layout
from dynabatch.common.wire.model_signature import ModelSignature
from dynabatch.task import Task

FROZEN_POLICY = "stays on each worker as built (or as --init loads it); never sent, never updated"
FIXED_BUFFER_POLICY = "unchanged by training: rebuilt by the model factory in every process, never sent"
TRAINED_BUFFER_POLICY = (
    "changed by a training step: travels with every push and pull, held and averaged by "
    "shard 0; the evaluator and an export use the shard's"
)
COUNTER_POLICY = (
    "an integer counter a training step changes: each worker keeps its own, never sent; "
    "the evaluator and an export use the factory's"
)


@dataclass(frozen=True)
class Kept:
    """A tensor of the model's state that does not travel, and what becomes of it."""

    name: str
    shape: tuple[int, ...]
    policy: str


@dataclass(frozen=True)
class DryRun:
    """What `dynabatch check` reports."""

    signature: ModelSignature
    layout: Layout
    frozen: tuple[Kept, ...]
    buffers: tuple[Kept, ...]
    step_s: dict[int, float]  # batch size -> the fastest seconds of forward + backward
    fixed_s: float  # a of t(b) = a + c*b
    per_sample_s: float  # c

    @property
    def param_bytes(self) -> int:
        return self.signature.total * FLOAT_BYTES

    @property
    def bytes_per_step(self) -> int:
        """A worker's traffic per step: it pulls the flat vector and pushes a gradient of the same size."""
        return 2 * self.param_bytes


def _batch(data: Any, size: int, collate: Any) -> Any:
    """`size` samples from the front of `data` (repeated when the set is smaller)."""
    return collate([data[i % len(data)] for i in range(size)])


def time_steps(task: Task, model: torch.nn.Module, data: Any, batches: Sequence[int], repeats: int) -> dict[int, float]:
    """The fastest of `repeats` forward + backward passes (what a worker's compute phase does) at each batch size.

    The fastest, not the median: on a busy machine most steps of a small model
    are preempted, and medians can fit a negative cost per sample (bench/RESULTS.md
    15); what the step costs is what it takes when nothing else runs. The sizes
    take turns; one untimed round first warms up the allocator and the kernels.
    """
    loss_fn, collate = task.loss_fn(), task.collate_fn()
    ready = {b: _batch(data, b, collate) for b in batches}
    times: dict[int, list[float]] = {b: [] for b in batches}
    model.train()
    for round_ in range(repeats + 1):
        for b in batches:
            start = time.perf_counter()
            model.zero_grad(set_to_none=False)
            torch.autograd.backward(loss_fn(model, ready[b]))  # Tensor.backward is untyped in torch
            if round_:
                times[b].append(time.perf_counter() - start)
    return {b: min(t) for b, t in times.items()}


def dry_run(task: Task, job: JobConfig, batches: Sequence[int] = (16, 64), repeats: int = 5) -> DryRun:
    """Check the task as `dynabatch run` would (TaskError if it cannot train), then measure it."""
    sig, data, _ = check_task(task, job.seed)
    model = task.build_model(job.seed)
    fresh = dict(task.build_model(job.seed).named_buffers())
    step_s = time_steps(task, model, data, sorted(set(batches)), repeats)
    fixed_s, per_sample_s = fit_line(list(step_s.items()))
    frozen = tuple(
        Kept(name, tuple(p.shape), FROZEN_POLICY) for name, p in model.named_parameters() if not p.requires_grad
    )
    travelling = set(sig.buffer_names)
    buffers = tuple(
        Kept(
            name,
            tuple(b.shape),
            TRAINED_BUFFER_POLICY
            if name in travelling
            else FIXED_BUFFER_POLICY
            if torch.equal(b, fresh[name])
            else COUNTER_POLICY,
        )
        for name, b in model.named_buffers()
    )
    return DryRun(
        sig, make_layout(sig.total, job.chunk_bytes, job.shards), frozen, buffers, step_s, fixed_s, per_sample_s
    )


def format_dry_run(run: DryRun, job: JobConfig, task_name: str) -> str:
    """The report, one fact a line."""
    sig, layout = run.signature, run.layout
    width = max(len(p.name) for p in sig.params)
    lines = [
        f"task: {task_name}",
        f"model built twice under seed {job.seed}: same initial parameters: yes",
        f"training set: {sig.train_size} samples",
        f"trainable parameters: {len(sig.params)} tensors, {sig.total:,} values, {run.param_bytes:,} bytes (float32)",
        *(f"  {p.name:<{width}}  {str(list(p.shape)):<16} {int(torch.Size(p.shape).numel()):>12,}" for p in sig.params),
        f"chunk layout (--chunk-bytes {job.chunk_bytes}, --shards {job.shards}): {len(layout.chunks)} chunk(s)",
    ]
    for shard in range(layout.num_shards):
        mine = layout.for_shard(shard)
        values = sum(c.length for c in mine)
        ids = ", ".join(str(c.id) for c in mine[:12]) + (", ..." if len(mine) > 12 else "")
        lines.append(
            f"  shard {shard}: {len(mine)} chunk(s) [{ids}], {values:,} values, {values * FLOAT_BYTES:,} bytes"
        )
    for title, kept in (("frozen parameters", run.frozen), ("buffers", run.buffers)):
        lines.append(f"{title}: {len(kept) or 'none'}")
        lines += [f"  {k.name} {list(k.shape)}: {k.policy}" for k in kept]
    lines.append(
        "training step (forward + backward, fastest): "
        + ", ".join(f"batch {b}: {1000 * s:.2f} ms" for b, s in run.step_s.items())
    )
    if run.per_sample_s > 0:
        at_global = run.fixed_s + run.per_sample_s * job.global_batch
        lines.append(
            f"fitted step time t(b) = a + c*b: a = {1000 * run.fixed_s:.3f} ms, "
            f"c = {1e6 * run.per_sample_s:.2f} us/sample; the whole --global-batch {job.global_batch} "
            f"on one such worker: {1000 * at_global:.1f} ms ({job.global_batch / at_global:,.0f} samples/s)"
        )
    else:
        lines.append(
            f"fitted step time t(b) = a + c*b: a = {1000 * run.fixed_s:.3f} ms, c = "
            f"{1e6 * run.per_sample_s:.2f} us/sample: not resolved, fixed costs dominate at these batch "
            "sizes (try larger --batches)"
        )
    lines.append(
        f"bytes per step and worker: {run.bytes_per_step:,} (pull {run.param_bytes:,} + push {run.param_bytes:,})"
    )
    return "\n".join(lines)
