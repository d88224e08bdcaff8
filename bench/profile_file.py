"""A cluster file (common/cluster_file.py owns the format) as the simulator's workers and settings
(`python -m bench.simulate --profile-file FILE.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.simulate import WorkerSpec
from dynabatch.common.cluster_file import ClusterFile, ClusterFileError, parse_cluster, read_cluster

ProfileError = ClusterFileError


@dataclass(frozen=True)
class ClusterProfile:
    """What a profile file describes: the workers and the job's transfer settings (SimConfig's fields)."""

    name: str
    workers: tuple[WorkerSpec, ...]
    wire_bytes: float = 0.0
    global_batch: int = 0
    shards: int = 1
    shard_mbit: float = 0.0

    def sim_settings(self) -> dict[str, Any]:
        """The SimConfig fields this profile sets (the global batch is the caller's: it has its own default)."""
        return {"wire_bytes": self.wire_bytes, "shards": self.shards, "shard_mbit": self.shard_mbit}


def simulated(cluster: ClusterFile) -> ClusterProfile:
    """The simulator's view of a cluster file: one WorkerSpec per worker."""
    workers = tuple(WorkerSpec(g.slowdown, join_s=g.join_s, leave_s=g.leave_s, fixed_s=g.device.fixed_s,
                               per_sample_s=g.device.per_sample_s, max_batch=g.device.max_batch,
                               link_mbit=g.link_mbit, latency_s=g.latency_s) for g in cluster.workers())
    return ClusterProfile(cluster.name, workers, cluster.model_bytes, cluster.global_batch, cluster.shards,
                          cluster.shard_mbit)


def parse_profile(text: str, where: str = "profile") -> ClusterProfile:
    """The simulated cluster a profile file's text describes; raises ProfileError naming `where` and the field."""
    return simulated(parse_cluster(text, where))


def read_profile(path: str | Path) -> ClusterProfile:
    """The simulated cluster described in the file at `path`."""
    return simulated(read_cluster(path))
