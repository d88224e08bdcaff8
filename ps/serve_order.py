"""The order a shard serves what waits: the scheduler's rank of the sender first, then the front of the model.

The scheduler ranks the live workers (scheduler/serving_priority.py: a round's
slowest first, otherwise the most transfer-bound first) and tells every shard in
its answer (`ShardAssignment.serve_ranks`). That answer is the only source: a rank
written into a worker's own PULL or PUSH is not a field of those messages, so
decoding drops it, and nothing a worker sends moves it ahead of another. A worker
the scheduler did not rank (none are ranked under `--chunk-schedule fixed`) comes
after every ranked one. Within one worker the front of the model goes first
(smallest chunk id), as the next forward pass needs it; a message that failed to
decode goes before everything, so that its ERROR is not held up.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynabatch.common.net.transport import Incoming


def front_chunk(incoming: Incoming) -> int:
    """The smallest chunk id a message touches (-1: a message that did not decode; 0: one that names none)."""
    msg = incoming.message
    if msg is None:
        return -1
    if msg.chunks:
        return min(c.id for c in msg.chunks)
    ids = getattr(msg.body, "ids", None)
    return min(ids) if ids else 0


def rank_of(worker: str, ranks: Mapping[str, int]) -> int:
    """`worker`'s serving rank; past every ranked worker if the scheduler gave it none."""
    return ranks.get(worker, len(ranks))


def serve_key(incoming: Incoming, ranks: Mapping[str, int]) -> tuple[int, int]:
    """Lower is served first: (the sender's rank, the message's front chunk); undecoded messages first of all."""
    msg = incoming.message
    if msg is None:
        return (-1, -1)
    return (rank_of(msg.sender, ranks), front_chunk(incoming))
