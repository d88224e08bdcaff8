"""The order in which shards serve the workers' waiting messages: which worker the job waits for most.

In a protocol that closes rounds (ssgd, local, msd, rennala, softsync), every
round ends when its last contribution arrives, and that is the worker whose
compute and transfer take longest: serving it first shortens every round, and
serving the others before it only makes them wait sooner. In an asynchronous
protocol nobody waits on anyone, and a worker gains most from being served first
where its step is mostly transfer: its compute cannot hide the wait, while a
compute-bound worker's can. So the ranks are: rounds, the longest own step (its
compute and transfer, not the round's wait) first; otherwise the largest share of
transfer in the step first. Within one worker, shards serve the front of the
model first, as before (ps/serve_order.py). Ranks start at 0 (served first); the
shards take them only from the scheduler's answer, never from a worker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerTimes:
    """One worker's last step: its own seconds (compute and transfer, no waiting for others) and of them
    the seconds moving its model and gradient."""

    own_s: float
    transfer_s: float


def serving_ranks(workers: dict[str, WorkerTimes], rounds: bool) -> dict[str, int]:
    """Worker id -> rank (0 first): the round's critical path first where `rounds`, else the most
    communication-bound first; ties by id, so that every shard orders them alike."""

    def key(wid: str) -> tuple[float, str]:
        t = workers[wid]
        share = t.own_s if rounds else (t.transfer_s / t.own_s if t.own_s > 0 else 0.0)
        return (-share, wid)

    return {wid: rank for rank, wid in enumerate(sorted(workers, key=key))}
