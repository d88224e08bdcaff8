"""How far any wire schedule could take a synchronous round on a cluster file: the round's lower bounds.

A round of `ssgd` under `--batch-policy fixed` gives each of n workers B/n samples; worker i computes for C_i,
moves the model's M bytes each way over its link (L_i a direction), and the shards serve each request's part at
their rate (S a request; all n pulls and n pushes of a round pass through them). A schedule of the wire decides
only who the shards serve first, how chunks are grouped and how many bytes may be in flight; whatever it decides,
the round takes at least:

- `order`: the shards' busy time (2 n S), and the critical worker's path served first with nothing ahead of it,
  its transfers and compute one after the other as the simulator models them (S + L_i + C_i + L_i + S). What
  ranking the critical worker first can reach.
- `overlap`: as `order`, but each worker's compute hidden perfectly behind its own transfers (max(C_i, 2 L_i)):
  the most chunk sizes and credits can add by overlapping a step's transfers with its compute.
- `duplex`: as `overlap`, but with a worker's push of one round and its pull of the next on the wire at once (its
  link carries both directions: max(C_i, L_i)); the step as built pulls only after its push is acknowledged, so
  this is what a change of the step (not of the schedule) could add.

Each bound is given as samples/s (B over the round), to set beside the measured fixed and scheduled runs
(bench/simulate_wire.py):

    python -m bench.wire_bounds bench/profiles/slow_link3.json bench/profiles/slow_member8.json \\
        bench/profiles/ps_bound64.json:1 bench/profiles/ps_bound64.json:4 bench/profiles/mixed_links16.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from dynabatch.common.planning.cluster_file import ClusterFile, read_cluster


@dataclass(frozen=True)
class RoundBounds:
    """The shortest round each kind of freedom allows, in seconds, and the global batch a round trains."""

    order_s: float
    overlap_s: float
    duplex_s: float
    batch: int


def round_bounds(cluster: ClusterFile, shards: int = 0) -> RoundBounds:
    """The lower bounds of a synchronous round of `cluster` at `shards` shards (0: the file's) under a fixed split."""
    workers = cluster.workers()
    n, shards = len(workers), shards or cluster.shards
    batch = cluster.global_batch or 16 * n
    share = batch / n
    serve_s = 8.0 * cluster.model_bytes / shards / (cluster.shard_mbit * 1e6) if cluster.shard_mbit > 0 else 0.0
    busy_s = 2 * n * serve_s
    paths = [
        (g.device.fixed_s + g.device.per_sample_s * min(share, g.device.max_batch or share), link(cluster, g.link_mbit))
        for g in workers
    ]
    return RoundBounds(
        order_s=max(busy_s, max(2 * serve_s + c + 2 * one_way for c, one_way in paths)),
        overlap_s=max(busy_s, max(max(c, 2 * one_way) for c, one_way in paths)),
        duplex_s=max(busy_s, max(max(c, one_way) for c, one_way in paths)),
        batch=batch,
    )


def link(cluster: ClusterFile, mbit: float) -> float:
    """Seconds for the model's bytes to cross a link of `mbit` (0: instant)."""
    return 8.0 * cluster.model_bytes / (mbit * 1e6) if mbit > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_bounds", description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="FILE.json or FILE.json:SHARDS")
    args = p.parse_args(argv)
    print("| profile | shards | bound by order: samples/s | by overlap | by duplex |")
    print("|---|---:|---:|---:|---:|")
    for spec in args.profiles:
        path, _, shards = spec.partition(":")
        cluster = read_cluster(path)
        b = round_bounds(cluster, int(shards or 0))
        print(
            f"| {cluster.name} | {shards or cluster.shards} | {b.batch / b.order_s:,.0f} | "
            f"{b.batch / b.overlap_s:,.0f} | {b.batch / b.duplex_s:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
