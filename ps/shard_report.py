"""What a shard tells the scheduler: who it is (HELLO), and in each heartbeat what only it knows.

Its heartbeat carries the model's version and the samples pushed into it (a drop
in them, after a restart or a rollback, is work the scheduler counts back into the
job), the worker set and push bounds it applied (the scheduler hands a worker a
new or larger batch only once every shard reports them), the training set's size
from the model signature, what its protocol discarded, the workers it quarantined,
and the model's health, its last good checkpoint and the last rollback it applied.
"""

from __future__ import annotations

import socket

from dynabatch.common.wire.messages import Hello, Role, ShardHeartbeat
from dynabatch.ps.good_checkpoint import GoodCheckpoint
from dynabatch.ps.held_model import HeldModel
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.serving_load import ServingLoad


def shard_hello(shard_index: int, name: str, endpoint: str, metrics_url: str) -> Hello:
    """The HELLO of shard `shard_index`, which workers reach at `endpoint`."""
    return Hello(
        role=Role.SHARD,
        host=socket.gethostname(),
        metrics_url=metrics_url,
        endpoint=endpoint,
        shard_index=shard_index,
        name=name,
    )


def shard_heartbeat(
    served: ServedJob,
    kept: GoodCheckpoint,
    held: HeldModel | None,
    membership: int,
    live: set[str],
    load: ServingLoad,
) -> ShardHeartbeat:
    """The shard's report: `held` is its model (None: none yet), `membership` the number of the worker set it
    applied, `live` that set's workers (those of them it quarantined are reported for the scheduler to drop),
    `load` the seconds it spent serving pulls and pushes and their wait."""
    return ShardHeartbeat(
        batches=served.assigned.told,
        version=held.state.version if held is not None else 0,
        samples=held.state.samples_seen if held is not None else 0,
        membership=membership,
        train_size=held.setup.signature.train_size if held is not None else 0,
        discarded=held.state.discarded if held is not None else 0,
        quarantined=sorted(served.bounds.quarantined & live),
        model_problem=kept.health.problem,
        good_version=kept.good_version,
        rollbacks=kept.rollbacks,
        protocol=served.job.protocol,
        refused_protocol=served.refused_protocol,
        busy_s=load.busy_s,
        queued_s=load.queued_s,
        busy_sq_s=load.busy_sq_s,
        served=load.served_count,
        transfers=load.transfers,
        pushed=sorted(load.pushers & live),
    )
