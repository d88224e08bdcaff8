"""The numbers in a PUSH, bounded by what its sender was told.

A worker's batch is what the scheduler assigned it: the shard learns every live
worker's batch with the live set (ShardAssignment.batches: the larger of its allocation
and every batch it was handed under an assignment it may still be stepping with),
keeps the larger of the last two different bounds it was told (a push may arrive after
the worker's report of the step that sent it), and echoes the bounds it applied in
its heartbeats: the scheduler gives a worker a larger batch only once every shard
reports that it applied it, so no honest push can reach a shard before its bound. Whatever a
worker was told never exceeds the job's --max-batch, and a `local` push sums
exactly H <= --local-steps local steps. msd never waits for its previous delta:
while that delta is slow to come back (its round waits on slower workers) the
worker keeps stepping, and its next push covers every step since the last, so an
msd push may carry `OVERLAP_SLACK` times H0 steps' samples: a worker 16 times faster
than the slowest in its round. A larger count would outweigh every honest worker
in the shard's sample-weighted average, so it is refused. A chunk's base version
can never be ahead of the shard's chunk: no worker can have pulled a version
that does not exist yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError

OVERLAP_SLACK = 16  # a push of a protocol that steps on while its delta is averaged may cover this many rounds


def push_steps(job: JobConfig) -> int:
    """The most steps' samples one PUSH of `job` can honestly sum (1 for a gradient)."""
    spec = protocol_spec(job.protocol)
    steps = job.local_steps if spec.local_steps else 1
    return steps * (OVERLAP_SLACK if spec.overlaps_rounds else 1)


def max_push_samples(job: JobConfig) -> int:
    """The most samples one PUSH of `job` can honestly carry, whoever sends it."""
    return job.max_batch * push_steps(job)


@dataclass
class AssignedBatches:
    """Each live worker's batch as the scheduler last told this shard, and as it told it before that
    (`told` None: no assignment applied yet, which the shard's heartbeat says: ShardHeartbeat.batches)."""

    steps: int  # push_steps of the job
    job_max: int  # max_push_samples of the job
    told: dict[str, int] | None = None
    before: dict[str, int] = field(default_factory=dict)

    def update(self, batches: Mapping[str, int]) -> bool:
        """The scheduler's latest bounds (ShardAssignment.batches); True if a worker's bound grew, which the scheduler
        must hear before it hands that worker the larger batch. Every answer repeats the bounds: one that
        repeats them changes nothing (else `before` would be forgotten a heartbeat later, whatever is in flight)."""
        if self.told is not None and batches == self.told:
            return False
        told = self.told or {}
        grew = any(b > told.get(w, 0) for w, b in batches.items())
        self.before, self.told = told, dict(batches)
        return grew

    def limit(self, worker: str) -> int:
        """The most samples a PUSH from `worker` may claim now (0: it holds no batch)."""
        told = self.told or {}
        return min(self.job_max, max(told.get(worker, 0), self.before.get(worker, 0)) * self.steps)


def check_push_samples(samples: int, worker: str, assigned: AssignedBatches) -> None:
    """Refuse (`bad_field`) a PUSH claiming more samples than its sender's assigned batch covers."""
    limit = assigned.limit(worker)
    if samples > limit:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"PUSH.samples {samples} exceeds {limit}, what {worker!r} was assigned "
            f"(its batch, times {assigned.steps} step(s) for a delta protocol)",
        )


def check_push_numbers(
    samples: int, base_versions: Mapping[int, int], chunk_versions: Mapping[int, int], max_samples: int
) -> None:
    """Refuse (`bad_field`, naming the field) a PUSH whose samples or chunk base versions cannot be true."""
    if samples <= 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"PUSH.samples must be positive, got {samples}")
    if samples > max_samples:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"PUSH.samples {samples} exceeds {max_samples}, the most one push of this "
            "job can carry (--max-batch, times --local-steps with slack for delta protocols)",
        )
    for cid, base in base_versions.items():
        if base > chunk_versions[cid]:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"PUSH.chunks[{cid}].version {base} is ahead of the shard's "
                f"version {chunk_versions[cid]} of that chunk",
            )
