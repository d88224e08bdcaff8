"""`--protocol auto --cluster-profile FILE`: the update protocol chosen from a cluster file before the shards start
(without a file, the scheduler chooses it at run time: common/planning/protocol_switch.py).

The shards take their update rule from the protocol when they start, so unlike the batch policy (scheduler/
auto_policy.py) the protocol cannot follow the workers as the scheduler measures them: it is chosen from a
description of the cluster given up front (`--cluster-profile FILE.json`, the format of
common/planning/cluster_file.py, as `dynabatch plan --profile` reads it and `dynabatch check --save-profile`
writes it), by the rule `dynabatch plan` prints (common/planning/auto_choice.py `choose` over the protocols the
predictor models), at the job's global batch and chunk size. The command that starts the scheduler resolves it
(`dynabatch run`, `dynabatch scheduler`); a job with `auto` unresolved never reaches a shard or a worker
(`job_from_dict` refuses it).
"""

from __future__ import annotations

from dataclasses import replace

from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.auto_choice import choose
from dynabatch.common.planning.cluster_file import ClusterFileError, read_cluster
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import cluster_of
from dynabatch.common.protocols import SPECS


def resolved(job: JobConfig) -> tuple[JobConfig, str]:
    """`job` with `--protocol auto` replaced by the protocol predicted to reach the target first on the cluster its
    --cluster-profile describes, and why, naming the file ("" when the protocol was given). The job returned no
    longer names the file, which only auto reads (`refuse_unread_settings`: the scheduler `dynabatch run` starts
    is handed the job as resolved). ConfigError naming the file when it cannot be read."""
    if SPECS.get(job.protocol) is not None or not job.cluster_profile:  # auto without a file: chosen at run time
        return job, ""
    try:
        described = read_cluster(job.cluster_profile)
    except ClusterFileError as exc:
        raise ConfigError(f"--cluster-profile: {exc}") from None
    cluster = replace(
        cluster_of(described, job.global_batch, job.chunk_bytes, job.min_batch), global_batch=job.global_batch
    )
    choice = choose(cluster, STUDY_NOISE)
    chosen = replace(job, protocol=choice.protocol, cluster_profile="")  # read: the job now names its protocol
    chosen.validate()
    return chosen, f"{choice.protocol} ({choice.reason}; from {job.cluster_profile}, {len(cluster.nodes)} workers)"
