"""ps/senders.py: a live worker's name is bound to the first connection that uses it, until it leaves."""

from __future__ import annotations

import pytest

from dynabatch.common.wire.frames import Message, ProtocolError
from dynabatch.common.wire.messages import Pull, Push
from dynabatch.ps.senders import SenderBindings

A, B = b"conn-a", b"conn-b"


def _refused(bindings: SenderBindings, worker: str, identity: bytes) -> None:
    with pytest.raises(ProtocolError) as refused:
        bindings.check(worker, identity)
    assert refused.value.code == "bad_sender"


def test_the_first_connection_of_a_live_worker_holds_its_name() -> None:
    bindings = SenderBindings()
    bindings.set_live({"w0", "w1"})
    bindings.check("w0", A)
    bindings.check("w0", A)
    _refused(bindings, "w0", B)
    bindings.check("w1", B)  # another worker binds its own connection
    _refused(bindings, "w1", A)


def test_a_name_that_is_not_live_binds_nothing() -> None:
    bindings = SenderBindings()
    bindings.set_live({"w0"})
    bindings.check("evaluator", A)
    bindings.check("evaluator", B)
    assert bindings.bound == {}


def test_a_worker_that_leaves_the_live_set_is_forgotten_and_binds_afresh() -> None:
    bindings = SenderBindings()
    bindings.set_live({"w0", "w1"})
    bindings.check("w0", A)
    bindings.check("w1", A)
    bindings.set_live({"w1"})
    assert bindings.bound == {"w1": A}
    bindings.set_live({"w0", "w1"})
    bindings.check("w0", B)
    _refused(bindings, "w0", A)


def test_a_workers_serving_rank_goes_only_to_the_connection_bound_to_it() -> None:
    bindings = SenderBindings()
    bindings.set_live({"w0", "w1"})
    bindings.check("w0", A)
    _refused(bindings, "w0", B)  # another connection that names w0 is refused, and does not take its rank
    assert bindings.by_connection({"w0": 0, "w1": 1}) == {A: 0}  # w1 has not spoken yet: no connection ranked
    bindings.check("w1", B)
    assert bindings.by_connection({"w0": 1, "w1": 0}) == {A: 1, B: 0}


def test_only_a_live_workers_own_connection_speaks_for_it_and_asking_binds_nothing() -> None:
    """What a shard reports as having pushed (ShardHeartbeat.pushed): a forged name, or a live worker's name from a
    connection not bound to it, is no one's push, and asking binds no connection."""
    bindings = SenderBindings()
    bindings.set_live({"w0", "w1"})
    assert not bindings.speaks_for("w0", A), "not bound yet: its first message binds it, not this question"
    assert bindings.bound == {}
    bindings.check("w0", A)
    assert bindings.speaks_for("w0", A)
    assert not bindings.speaks_for("w0", B), "another connection in its name"
    assert not bindings.speaks_for("stranger", A), "not live"
    push, pull = Message(Push(samples=8), job="j", sender="w0"), Message(Pull(), job="j", sender="w0")
    assert bindings.pusher(push, A, "j") == "w0"
    assert bindings.pusher(push, B, "j") == "" and bindings.pusher(push, A, "other") == "", "another's, another job's"
    assert bindings.pusher(pull, A, "j") == "" and bindings.pusher(None, A, "j") == "", "no push, nothing decoded"
