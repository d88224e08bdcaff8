"""What a restarted shard no longer holds: the versions and samples after its checkpoint.

A shard killed with `kill -9` comes back from its last checkpoint. Its heartbeats
carry its version and the samples pushed to it (both restored from the
checkpoint), so the drop between the last report of its old process and the
first of its new one is exactly the work lost. The scheduler counts those
samples back into the job, so that the job still trains as long as it was asked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardMark:
    """The newest version and sample count a shard slot has reported."""

    version: int = 0
    samples: int = 0


@dataclass
class LostWork:
    """Versions and samples shard `shard` lost when it restarted."""

    shard: int
    versions: int
    samples: int


def lost_work(shard: int, mark: ShardMark, version: int, samples: int, countable: int) -> LostWork | None:
    """The work shard `shard` lost if it now reports `version` and `samples` after `mark`, else None.

    A shard's version never goes back while its process lives, so a lower one
    means a restart from an older state. The samples counted back are at most
    `countable` (the job's samples not yet counted back): a shard's report can
    never make the job train longer than it has trained.
    """
    if version >= mark.version:
        return None
    return LostWork(shard, mark.version - version, max(0, min(mark.samples - samples, countable)))
