"""What each client role's CURVE key may send: a worker key cannot register a shard or report an evaluation.

Under CURVE every connection authenticated with one role's key (common/net/curve.py
names it as the connection's ZAP user id). A server checks that role before it
reads a message's fields, so a stolen worker key (the most widely spread secret
of a job: every worker machine holds it) can train, and no more. Without CURVE
there is no key and the check passes: roles are then whatever peers claim.
"""

from __future__ import annotations

from collections.abc import Collection

from dynabatch.common.net.curve import KeyRole
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import Role

HELLO_KEY_ROLE = {Role.SHARD: KeyRole.SHARD, Role.WORKER: KeyRole.WORKER, Role.EVALUATOR: KeyRole.EVALUATOR}
"""The key each member role registers with."""


def check_key_role(key_role: KeyRole | None, allowed: Collection[KeyRole], what: str) -> None:
    """Refuse (`bad_role`) `what` from a connection whose key is of none of the `allowed` roles."""
    if key_role is None or key_role in allowed:
        return
    raise ProtocolError(
        ErrorCode.BAD_ROLE,
        f"{what} is taken only from a {' or '.join(sorted(allowed))} key; this "
        f"connection authenticated with a {key_role} key",
    )
