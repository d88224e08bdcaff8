"""bench/wire_bounds.py: the shortest synchronous round each freedom of the wire allows, on hand-made clusters."""

from __future__ import annotations

import json

import pytest

from bench.wire_bounds import round_bounds
from dynabatch.common.planning.cluster_file import parse_cluster


def _cluster(workers: list[dict[str, float]], shard_mbit: float, batch: int) -> str:
    return json.dumps({"model_bytes": 1e8, "global_batch": batch, "shard_mbit": shard_mbit, "workers": workers})


def test_a_slow_link_bounds_the_round_by_its_transfers_and_only_a_duplex_step_halves_them() -> None:
    # 100 MB over 100 Mbit is 8 s a direction; compute 1.064 s; the shard serves a request in 0.08 s (10 Gbit).
    fast = {"count": 2, "fixed_s": 1.0, "per_sample_s": 0.001, "link_mbit": 10000}
    slow = {"count": 1, "fixed_s": 1.0, "per_sample_s": 0.001, "link_mbit": 100}
    b = round_bounds(parse_cluster(_cluster([fast, slow], 10000, 192)))
    assert b.batch == 192
    assert b.order_s == pytest.approx(0.16 + 1.064 + 16.0)
    assert b.overlap_s == pytest.approx(16.0)
    assert b.duplex_s == pytest.approx(8.0)


def test_a_busy_shard_bounds_every_schedule_alike() -> None:
    # 64 workers, 128 requests of 100 MB a round at 10 Gbit: 10.24 s, beyond any worker's own path (0.16 s of link).
    cluster = parse_cluster(
        _cluster([{"count": 64, "fixed_s": 0.1, "per_sample_s": 0.001, "link_mbit": 10000}], 10000, 4096)
    )
    b = round_bounds(cluster)
    assert b.order_s == b.overlap_s == b.duplex_s == pytest.approx(10.24)
    assert round_bounds(cluster, shards=4).order_s == pytest.approx(2.56)
