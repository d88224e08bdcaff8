"""The caps on a server socket's connections, and the tally that applies them: pure, no sockets."""

from __future__ import annotations

from dynabatch.common.net.connection_caps import PER_SOURCE, RESERVE, ConnectionCaps, ConnectionTally


def test_the_caps_keep_a_reserve_of_descriptors_below_the_limit() -> None:
    assert ConnectionCaps.for_descriptor_limit(20_000) == ConnectionCaps(20_000 - RESERVE, PER_SOURCE)
    assert ConnectionCaps.for_descriptor_limit(1_048_576) == ConnectionCaps(1_048_576 - RESERVE, PER_SOURCE)
    # A small limit keeps half for the process, and one source may then take all the rest.
    assert ConnectionCaps.for_descriptor_limit(400) == ConnectionCaps(200, 200)
    assert ConnectionCaps.for_descriptor_limit(1024) == ConnectionCaps(1024 - RESERVE, 1024 - RESERVE)


def test_one_source_is_held_to_its_cap_and_others_still_get_in() -> None:
    tally = ConnectionTally(ConnectionCaps(total=10, per_source=3))
    assert [tally.admit(fd, "10.0.0.1") for fd in range(5)] == [None, None, None, "source", "source"]
    assert tally.admit(5, "10.0.0.2") is None
    assert tally.held == 4 and tally.held_from("10.0.0.1") == 3 and tally.held_from("10.0.0.2") == 1


def test_the_total_cap_holds_whatever_the_sources() -> None:
    tally = ConnectionTally(ConnectionCaps(total=4, per_source=3))
    assert [tally.admit(fd, f"10.0.0.{fd}") for fd in range(6)] == [None] * 4 + ["total", "total"]
    assert tally.held == 4


def test_a_released_connection_makes_room_and_a_refused_one_was_never_held() -> None:
    tally = ConnectionTally(ConnectionCaps(total=10, per_source=2))
    tally.admit(7, "10.0.0.1")
    tally.admit(8, "10.0.0.1")
    assert tally.admit(9, "10.0.0.1") == "source"
    tally.release(9)  # ZeroMQ reports the refused connection gone: nothing to give back
    assert tally.held_from("10.0.0.1") == 2
    tally.release(7)
    assert tally.admit(9, "10.0.0.1") is None
    tally.release(8)
    tally.release(9)
    assert tally.held == 0 and tally.held_from("10.0.0.1") == 0


def test_a_descriptor_admitted_again_replaces_its_old_connection() -> None:
    """A release the tally never saw cannot leave a phantom holding a place: the descriptor's reuse frees it."""
    tally = ConnectionTally(ConnectionCaps(total=10, per_source=1))
    tally.admit(7, "10.0.0.1")
    assert tally.admit(7, "10.0.0.1") is None
    assert tally.admit(7, "10.0.0.2") is None
    assert tally.held == 1 and tally.held_from("10.0.0.1") == 0 and tally.held_from("10.0.0.2") == 1
