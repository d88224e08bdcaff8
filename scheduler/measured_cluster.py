"""The cluster `--protocol auto` chooses on, as the scheduler measures it: each worker's compute curve and its
link's own transfer time, the shards' service time, in the predictor's terms (common/planning/predicted_cluster.py).

A worker reports its pulls and pushes as one span: its link and the shards' queue together. Where one shard bounds
the job every worker's transfers are long whatever its link; counted as link time they would be paid alike by
every protocol, and local SGD, which moves the model once per round of H steps, would never be seen to relieve the
shard. So the time a transfer spent at the shards (their reports: ShardHeartbeat.busy_s and queued_s over the
transfers they served) is taken off each worker's and given to the shards as their service time; the rest is
the worker's link (`measured_node`), which each protocol's model places itself (pipelined under a gradient step,
once a round under local SGD).

Under local SGD a worker reports a round's phases spread over its H steps (WorkerHeartbeat), so a reported step's
transfers are a round's over H, and it pulls and pushes once per H reported steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dynabatch.common.planning.optimum import Device
from dynabatch.common.planning.predicted_cluster import Cluster, measured_node
from dynabatch.scheduler.speed_model import StepModel


@dataclass(frozen=True)
class MeasuredWorker:
    """A worker as measured: its compute curve, the seconds of a reported step it spent not computing (pulls and
    pushes), its largest batch (0: none)."""

    compute: StepModel
    overhead_s: float
    cap: int = 0


@dataclass(frozen=True)
class ShardLoad:
    """What a shard reported since it started: its seconds serving pulls and pushes, the seconds they waited, and
    the transfers they moved (in whole parts of the model it holds: each worker's pull or push reaches every shard, so
    a whole-model transfer is one at each)."""

    busy_s: float
    queued_s: float
    transfers: float

    def service_s(self) -> float:
        """Seconds the shard served one transfer (its part of the model); 0 where none was counted."""
        return self.busy_s / self.transfers if self.transfers > 0 else 0.0

    def held_s(self) -> float:
        """Seconds one transfer spent at the shard, waiting and served."""
        return (self.busy_s + self.queued_s) / self.transfers if self.transfers > 0 else 0.0


def transfers_per_step(round_steps: int) -> float:
    """The whole-model transfers (pulls and pushes) one reported step makes: two, or two per local round of
    `round_steps`."""
    return 2.0 / max(1, round_steps)


def measured_cluster(
    workers: Mapping[str, MeasuredWorker],
    load: ShardLoad | None,
    model_bytes: float,
    global_batch: int,
    round_steps: int,
    local_steps: int,
    chunk_bytes: int,
    min_batch: int = 1,
) -> Cluster:
    """The predictor's cluster of the measured `workers` (in id order) under the running protocol, whose reported
    step is a round of `round_steps` (1: a gradient step): each its compute curve and cap, and as its link the
    transfers of a step less what they spent at the shards (`load`; None: nothing known of the shards, all link);
    the shards serving a transfer in the time they reported; `local_steps` the H local SGD would run. Where no
    worker reported the bytes it moved (`model_bytes` 0), the transfers still count, as one chunk's: the links and
    the shards' rate are in seconds per transfer, which any size expresses alike."""
    model_bytes = model_bytes if model_bytes > 0 else float(max(1, chunk_bytes))
    held = load.held_s() if load is not None else 0.0
    service = load.service_s() if load is not None else 0.0
    nodes = tuple(
        measured_node(
            Device(w.compute.fixed_s, w.compute.per_sample_s, w.cap),
            max(0.0, w.overhead_s * round_steps - 2 * held),
            model_bytes,
        )
        for w in (workers[k] for k in sorted(workers))
    )
    return Cluster(
        nodes,
        global_batch,
        model_bytes,
        max(1, round(model_bytes / chunk_bytes)) if chunk_bytes > 0 else 1,
        1,
        model_bytes * 8 / (service * 1e6) if service > 0 and model_bytes > 0 else 0.0,
        local_steps,
        min_batch,
    )


class TransferTally:
    """The running figures `measured_cluster` needs beyond the speed models: the model's bytes (what a worker's
    transfer moves, from the workers' reports), each shard's last report of its serving seconds and transfers (since
    it started), and each worker's first push."""

    def __init__(self) -> None:
        self.model_bytes = 0.0
        self.first_push: dict[str, tuple[float, int]] = {}  # by worker: seconds from its first batch to its first
        # push reaching the shards, and that batch
        self._moved: dict[str, tuple[int, int]] = {}  # by worker: its last reported steps and bytes
        self._shards: dict[int, ShardLoad] = {}  # by shard slot: its cumulative report

    def stepped(self, worker: str, steps: int, moved_bytes: int, round_steps: int) -> None:
        """A worker reported `steps` and `moved_bytes` in all (cumulative), a reported step being a round of
        `round_steps` over its H steps."""
        last_steps, last_bytes = self._moved.get(worker, (0, 0))
        self._moved[worker] = (steps, moved_bytes)
        new = steps - last_steps
        if new > 0 and moved_bytes > last_bytes:
            self.model_bytes = (moved_bytes - last_bytes) / (new * transfers_per_step(round_steps))

    def shard_reported(self, shard: int, busy_s: float, queued_s: float, transfers: float) -> None:
        """A shard's cumulative serving seconds and transfers (ShardHeartbeat.busy_s, queued_s, transfers)."""
        self._shards[shard] = ShardLoad(busy_s, queued_s, transfers)

    def pushed(self, worker: str, since_batch_s: float, batch: int) -> None:
        """A shard reported that a push of `worker`'s reached it (ShardHeartbeat.pushed), `since_batch_s` after the
        scheduler handed it its first batch, `batch`: the first such report spans the worker's first pull (with its
        wait and service at the shards), its compute of that batch and its push's link. Later ones change nothing."""
        self.first_push.setdefault(worker, (since_batch_s, batch))

    def forget(self, worker: str) -> None:
        """A worker that left."""
        self._moved.pop(worker, None)
        self.first_push.pop(worker, None)

    def load(self) -> ShardLoad | None:
        """The load of the shard slowest to serve a transfer, waiting included; None before a shard reported
        serving one."""
        served = [s for s in self._shards.values() if s.transfers > 0 and s.busy_s > 0]
        return max(served, key=ShardLoad.held_s) if served else None
