"""The numbers in a PUSH, bounded by what its sender was told.

A worker's batch never exceeds the job's --max-batch, and a `local` push sums
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

from typing import Mapping

from dynabatch.common.config import JobConfig
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.wire import ProtocolError

OVERLAP_SLACK = 16  # a push of a protocol that steps on while its delta is averaged may cover this many rounds


def max_push_samples(job: JobConfig) -> int:
    """The most samples one PUSH of `job` can honestly carry."""
    spec = protocol_spec(job.protocol)
    steps = job.local_steps if spec.local_steps else 1
    return job.max_batch * steps * (OVERLAP_SLACK if spec.overlaps_rounds else 1)


def check_push_numbers(samples: int, base_versions: Mapping[int, int], chunk_versions: Mapping[int, int],
                       max_samples: int) -> None:
    """Refuse (`bad_field`, naming the field) a PUSH whose samples or chunk base versions cannot be true."""
    if samples > max_samples:
        raise ProtocolError("bad_field", f"PUSH.samples {samples} exceeds {max_samples}, the most one push of this "
                            "job can carry (--max-batch, times --local-steps with slack for delta protocols)")
    for cid, base in base_versions.items():
        if base > chunk_versions[cid]:
            raise ProtocolError("bad_field", f"PUSH.chunks[{cid}].version {base} is ahead of the shard's "
                                f"version {chunk_versions[cid]} of that chunk")
