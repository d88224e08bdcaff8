"""The ids the scheduler gives the members of a job (w0, w1, ...; eval0, ...; ps0, ...), made here only.

An id names a member in every message it sends; nothing reads it back: the number
in it travels on its own (`Welcome.number`), which is what a worker seeds its order
of the training set with (worker/batch_source.py).
"""

from __future__ import annotations

from dynabatch.common.wire.messages import Role

PREFIXES = {Role.WORKER: "w", Role.EVALUATOR: "eval", Role.SHARD: "ps"}


def member_id(role: Role, number: int) -> str:
    """The id of the `number`-th member of `role` to register (a shard's number is its index)."""
    return f"{PREFIXES[role]}{number}"
