"""The ids the scheduler gives the members of a job (w0, w1, ...; eval0, ...; ps0, ...), made and read here only.

A worker's number seeds its own order of the training set (worker/batch_source.py),
so the format is a fact both sides of the wire depend on: the scheduler makes an id
with `member_id`, and whoever needs the number back reads it with `member_number`.
"""

from __future__ import annotations

import re

from dynabatch.common.messages import Role

PREFIXES = {Role.WORKER: "w", Role.EVALUATOR: "eval", Role.SHARD: "ps"}
_ID = re.compile(rf"^(?:{'|'.join(map(re.escape, PREFIXES.values()))})(\d+)$")


def member_id(role: Role, number: int) -> str:
    """The id of the `number`-th member of `role` to register (a shard's number is its index)."""
    return f"{PREFIXES[role]}{number}"


def member_number(member: str) -> int:
    """The number in an id `member_id` made; ValueError for any other string."""
    found = _ID.match(member)
    if found is None:
        raise ValueError(f"{member!r} is not a member id the scheduler gives (w<n>, eval<n>, ps<n>)")
    return int(found.group(1))
