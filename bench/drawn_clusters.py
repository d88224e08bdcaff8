"""Random mixed clusters that no tuning saw: the out-of-sample check of the `auto` rule (issue 37).

The regime study tunes every method on the cluster files of bench/profiles/; a rule derived there and judged only
there could be fitted to them. These clusters are drawn afresh from a seed no tuning or profile uses, and mix
every regime at once: device curves of GPU and CPU classes (fixed and per-sample costs drawn across the ranges of
the published curves the files cite), memory caps, links from 10 Mbit/s to 25 Gbit/s, one to four shards with
their own service rate, a model of 4 to 100 MB on the wire and a global batch of 16 to 128 samples per worker.
Each is a `ClusterFile` (common/planning/cluster_file.py), so the simulator and the predictor read the same cluster.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from dynabatch.common.planning.cluster_file import ClusterFile, WorkerGroup
from dynabatch.common.planning.optimum import Device

DRAW_SEED = 2029
"""The seed the study's unseen clusters are drawn from: no tuning seed (100, 101), report seed (0 to 4) or profile
seed of bench/simulate.py is this one."""
LINKS_MBIT = (25000, 10000, 10000, 1000, 1000, 100, 10)
"""The links a group may have (10 Gbit/s and 1 Gbit/s twice as likely), with the latency each class has."""
LATENCY_S = {25000: 5e-5, 10000: 5e-5, 1000: 1e-4, 100: 1e-3, 10: 2e-2}
CAPS = (0, 64, 128, 256, 512, 1024)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _group(rng: random.Random) -> WorkerGroup:
    """A group of 2 to 8 alike workers: a GPU (a large fixed cost against its per-sample cost, the Sia curves of
    bench/profiles/) or a CPU (small fixed cost, slow per sample), a cap and a link."""
    if rng.random() < 0.75:
        device = Device(
            round(_log_uniform(rng, 0.02, 0.2), 4), round(_log_uniform(rng, 2e-4, 5e-3), 6), rng.choice(CAPS)
        )
    else:
        device = Device(round(_log_uniform(rng, 0.002, 0.02), 4), round(_log_uniform(rng, 5e-3, 3e-2), 6), 0)
    link = rng.choice(LINKS_MBIT)
    return WorkerGroup(rng.randint(2, 8), device, float(link), LATENCY_S[link])


def draw_cluster(rng: random.Random, name: str) -> ClusterFile:
    """One mixed cluster of 2 to 4 groups (4 to 32 workers); where the caps cannot hold the global batch, groups
    lose their cap (first drawn first) until they can."""
    groups = [_group(rng) for _ in range(rng.randint(2, 4))]
    n = sum(g.count for g in groups)
    per_worker = 2 ** rng.randint(4, 7)
    for i, g in enumerate(groups):
        if _holds(groups, per_worker * n):
            break
        groups[i] = replace(g, device=replace(g.device, max_batch=0))
    return ClusterFile(
        name,
        tuple(groups),
        model_bytes=round(_log_uniform(rng, 4e6, 1e8)),
        global_batch=per_worker * n,
        shards=rng.randint(1, 4),
        shard_mbit=float(rng.choice((10000, 25000))),
    )


def _holds(groups: list[WorkerGroup], global_batch: int) -> bool:
    """Whether the groups' caps leave room for `global_batch` (a group without a cap holds any batch)."""
    if any(g.device.max_batch == 0 for g in groups):
        return True
    return sum(g.count * g.device.max_batch for g in groups) >= global_batch


def draw_clusters(count: int, seed: int = DRAW_SEED) -> tuple[ClusterFile, ...]:
    """`count` clusters drawn from `seed`, named `drawn{i}`."""
    rng = random.Random(seed)
    return tuple(draw_cluster(rng, f"drawn{i}") for i in range(count))
