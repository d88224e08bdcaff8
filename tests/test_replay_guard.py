"""ps/replay_guard.py: each PUSH seq is taken once per (sender, connection), also after a restore."""

from __future__ import annotations

import pytest

from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.replay_guard import MAX_KEYS, WINDOW, ReplayGuard

A, B = b"conn-a", b"conn-b"


def _take(guard: ReplayGuard, seq: int, sender: str = "w0", identity: bytes = A) -> None:
    guard.check(sender, identity, seq)
    guard.take(sender, identity, seq, {sender})


def _refused(guard: ReplayGuard, seq: int, sender: str = "w0", identity: bytes = A) -> None:
    with pytest.raises(ProtocolError) as refused:
        guard.check(sender, identity, seq)
    assert refused.value.code == "replay"


def test_a_seq_is_taken_once_and_a_higher_one_always() -> None:
    guard = ReplayGuard()
    _take(guard, 5)
    _refused(guard, 5)
    _take(guard, 9)
    _refused(guard, 9)
    _refused(guard, 5)


def test_seqs_taken_out_of_order_within_the_window_are_each_taken_once() -> None:
    guard = ReplayGuard()
    for seq in (10, 7, 12, 8):  # one poll's messages, handled front of the model first
        _take(guard, seq)
    for seq in (10, 7, 12, 8):
        _refused(guard, seq)
    _take(guard, 11)
    _refused(guard, 12 - WINDOW)


def test_the_window_is_per_sender_and_per_connection() -> None:
    guard = ReplayGuard()
    _take(guard, 50)
    _take(guard, 1, identity=B)  # the same worker id from a new process (a new connection) starts at 1
    _take(guard, 1, sender="w1")
    _refused(guard, 50)


def test_a_restored_guard_refuses_everything_at_or_below_its_saved_marks() -> None:
    guard = ReplayGuard()
    for seq in (3, 4, 6):
        _take(guard, seq)
    again = ReplayGuard()
    again.restore(guard.saved())
    for seq in (1, 5, 6):  # 5 was never taken, but a restored shard cannot tell: it is refused too
        _refused(again, seq)
    _take(again, 7)


def test_connections_of_workers_no_longer_live_are_forgotten_beyond_the_cap() -> None:
    guard = ReplayGuard()
    for i in range(MAX_KEYS + 10):
        guard.take(f"gone{i}", A, 1, {"w0"})
    guard.take("w0", A, 1, {"w0"})
    assert len(guard.seen) == MAX_KEYS and ("w0", A) in guard.seen
