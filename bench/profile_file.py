"""A cluster file (common/planning/cluster_file.py owns the format) as the simulator's workers and settings
(`python -m bench.simulate --profile-file FILE.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.simulate import WorkerSpec
from dynabatch.common.planning.cluster_file import ClusterFile, ClusterFileError, parse_cluster, read_cluster

ProfileError = ClusterFileError


@dataclass(frozen=True)
class ClusterProfile:
    """A simulated cluster: its workers, and the file it was read from (None: a built-in profile), whose job fields
    are SimConfig's transfer settings."""

    name: str
    workers: tuple[WorkerSpec, ...]
    file: ClusterFile | None = None

    @property
    def global_batch(self) -> int:
        return self.file.global_batch if self.file else 0

    def sim_settings(self) -> dict[str, Any]:
        """The SimConfig fields this profile sets (the global batch is the caller's: it has its own default)."""
        if self.file is None:
            return {}
        return {"wire_bytes": self.file.model_bytes, "shards": self.file.shards, "shard_mbit": self.file.shard_mbit}


def simulated(cluster: ClusterFile) -> ClusterProfile:
    """The simulator's view of a cluster file: one WorkerSpec per worker."""
    workers = tuple(
        WorkerSpec(
            g.slowdown,
            join_s=g.join_s,
            leave_s=g.leave_s,
            fixed_s=g.device.fixed_s,
            per_sample_s=g.device.per_sample_s,
            max_batch=g.device.max_batch,
            link_mbit=g.link_mbit,
            latency_s=g.latency_s,
        )
        for g in cluster.workers()
    )
    return ClusterProfile(cluster.name, workers, cluster)


def parse_profile(text: str, where: str = "profile") -> ClusterProfile:
    """The simulated cluster a profile file's text describes; raises ProfileError naming `where` and the field."""
    return simulated(parse_cluster(text, where))


def read_profile(path: str | Path) -> ClusterProfile:
    """The simulated cluster described in the file at `path`."""
    return simulated(read_cluster(path))
