"""Which connection speaks for each live worker on this shard: trust on first use, per membership.

The shard learns the live workers from the scheduler, never their connections.
So the first ROUTER connection (routing id) that sends a PUSH, PULL or INIT in
a live worker's name is bound to it, and for as long as that worker stays live
any message in its name from another connection is refused (`bad_sender`): a
peer that names another worker as its sender can neither push into its rounds
nor take its pulls. The binding is forgotten when the worker leaves the live
set, so the same id under a new membership (or a worker that registered again)
binds afresh.

A worker that is not live (not yet admitted, an evaluator) binds nothing: the
shard refuses its pushes anyway (`unknown_sender`) and its pulls only read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.common.net.curve import KeyRole
from dynabatch.common.net.key_roles import check_key_role
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import Message, ProtocolError
from dynabatch.common.wire.messages import Init, Pull, Push

KEY_ROLES: dict[str, tuple[KeyRole, ...]] = {
    Push.TYPE: (KeyRole.WORKER,),
    Init.TYPE: (KeyRole.WORKER, KeyRole.EVALUATOR),  # an evaluator checks its model and reads it
    Pull.TYPE: (KeyRole.WORKER, KeyRole.EVALUATOR),
}
"""The roles of the keys (under CURVE) each message a shard takes from a peer may come from."""


@dataclass
class SenderBindings:
    """Worker id -> the routing id of the connection that first spoke for it while it was live."""

    live: set[str] = field(default_factory=set)
    bound: dict[str, bytes] = field(default_factory=dict)

    def set_live(self, workers: set[str]) -> None:
        """The scheduler's live set: bindings of workers that left it are forgotten."""
        self.live = set(workers)
        self.bound = {w: ident for w, ident in self.bound.items() if w in self.live}

    def check_message(self, msg: Message[Any], identity: bytes, key_role: KeyRole | None) -> None:
        """Refuse a message a shard takes from peers (KEY_ROLES) from a key of another role, or in a live worker's
        name from another connection than the one that first spoke for it."""
        allowed = KEY_ROLES.get(msg.type)
        if allowed is not None:
            check_key_role(key_role, allowed, msg.type)
            self.check(msg.sender, identity)

    def check(self, worker: str, identity: bytes) -> None:
        """Accept (binding on first use) or refuse a message in `worker`'s name from connection `identity`."""
        if worker not in self.live:
            return
        held = self.bound.setdefault(worker, identity)
        if held != identity:
            raise ProtocolError(
                ErrorCode.BAD_SENDER,
                f"{worker!r} speaks to this shard from another connection; a message "
                "in its name from this one is refused",
            )

    def pusher(self, msg: Message[Any] | None, identity: bytes, job: str) -> str:
        """The live worker a PUSH of `job` read from connection `identity` is from, if that connection is the one
        bound to speak for it; "" for any other message, and for a push in another's name or of a worker not live
        (ShardHeartbeat.pushed: a forged name is no one's push)."""
        if msg is None or msg.type != Push.TYPE or msg.job != job or not self.speaks_for(msg.sender, identity):
            return ""
        return msg.sender

    def speaks_for(self, worker: str, identity: bytes) -> bool:
        """Whether `worker` is live and connection `identity` is the one bound to speak for it (changes nothing)."""
        return worker in self.live and self.bound.get(worker) == identity

    def by_connection(self, ranks: Mapping[str, int]) -> dict[bytes, int]:
        """The scheduler's `ranks` of workers, keyed by the connection bound to speak for each (none yet: unranked)."""
        return {self.bound[w]: rank for w, rank in ranks.items() if w in self.bound}
