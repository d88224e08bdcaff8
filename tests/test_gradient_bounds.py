"""ps/gradient_bounds.py: a push's chunk norms bounded by the workers' typical norm, clipped, counted, quarantined."""

from __future__ import annotations

import math

import pytest
import torch

from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.gradient_bounds import MAX_TO_PARAMS, QUARANTINE_AFTER, Assessment, GradientBounds

LIVE = {"w0", "w1", "w2", "bad"}
PARAMS = {0: torch.full((100,), 100.0)}  # a norm of 1000: far above every honest push here


def _push(
    bounds: GradientBounds, worker: str, norm: float, samples: int = 32, seed: int = 0
) -> tuple[Assessment, bool]:
    g = torch.randn(100, generator=torch.Generator().manual_seed(seed))
    found = bounds.assess(worker, {0: g * (norm / float(g.norm()))}, samples, PARAMS, LIVE, 1.0)
    quarantined = bounds.record(found, LIVE)
    return found, quarantined


def _honest_history(bounds: GradientBounds, rounds: int = 6) -> None:
    for i in range(rounds):
        for w in ("w0", "w1", "w2"):
            found, _ = _push(bounds, w, 1.0 + 0.1 * (i % 3), seed=i)
            assert not found.clipped, "honest pushes of similar norms are never clipped"


def test_a_huge_push_is_clipped_to_the_bound_keeping_its_direction() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    found, _ = _push(bounds, "bad", 1e3, seed=99)
    taken = found.tensors[0]
    assert found.clipped == [0] and float(taken.norm()) == pytest.approx(4.0 * 1.0, rel=0.2)
    direction = torch.randn(100, generator=torch.Generator().manual_seed(99))
    assert torch.nn.functional.cosine_similarity(taken, direction, dim=0) > 0.999


def test_one_worker_pushing_often_and_big_does_not_move_the_reference() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    before = bounds.bound(0, 32, LIVE)
    for i in range(200):
        _push(bounds, "bad", 1e6, seed=i)
        bounds.quarantined.discard("bad")
        bounds.in_a_row["bad"] = 0
    assert bounds.bound(0, 32, LIVE) == pytest.approx(before, rel=0.2), "each worker counts once in the reference"


def test_a_push_of_fewer_samples_than_the_typical_batch_may_be_larger_as_its_noise_is() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    found, _ = _push(bounds, "w0", 7.0, samples=2)  # sqrt(32 / 2) = 4 times the room
    assert not found.clipped
    found, _ = _push(bounds, "w0", 7.0, samples=512)
    assert found.clipped, "a larger batch gets no more room than the typical norm"


def test_the_parameter_bound_gives_a_small_batch_the_room_its_noise_needs_and_no_more_step() -> None:
    """A 1-sample gradient of an honest --max-batch 1 worker measured 8 to 36 against a parameter norm of 8 in the
    reference job (B/n = 64): the bound is |p| / sqrt(share), and share * bound (what its weighted step may move
    the chunk) shrinks as sqrt(share)."""
    params = {0: torch.full((100,), 0.8)}  # norm 8
    g = torch.randn(100, generator=torch.Generator().manual_seed(5))
    one_sample = g * (36.0 / float(g.norm()))
    for share, clipped in ((1.0, True), (1 / 64, False)):
        found = GradientBounds(4.0).assess("w0", {0: one_sample}, 1, params, LIVE, share)
        assert bool(found.clipped) == clipped, share
    bounds = [
        (share, float(GradientBounds(4.0).assess("w0", {0: g * 1e6}, 1, params, LIVE, share).norms[0]))
        for share in (1.0, 1 / 4, 1 / 64)
    ]
    assert [round(b, 3) for _, b in bounds] == [8 * MAX_TO_PARAMS * k for k in (1, 2, 8)]
    assert [round(s * b, 3) for s, b in bounds] == [8 * MAX_TO_PARAMS * k for k in (1, 0.5, 0.125)]


def test_workers_of_different_batches_each_have_the_room_their_noise_needs() -> None:
    bounds = GradientBounds(4.0)
    for i in range(2 * 16):  # a 16-sample worker's noise-dominated norm is sqrt(256 / 16) = 4 times a 256-sample one's
        for w, samples, norm in (("w0", 256, 1.0), ("w1", 16, 4.0)):
            found, quarantined = _push(bounds, w, norm * (1.1 if i % 2 else 0.9), samples, seed=i)
            assert not found.clipped and not quarantined, (i, w)


def test_before_most_workers_have_pushed_a_push_is_bounded_by_its_chunks_parameters() -> None:
    bounds = GradientBounds(4.0)
    params = {0: torch.full((100,), 0.1)}  # norm 1
    g = torch.randn(100)
    found = bounds.assess("bad", {0: g * (1e3 / float(g.norm()))}, 32, params, LIVE, 1.0)  # the liar pushes first
    assert found.clipped and float(found.tensors[0].norm()) == pytest.approx(MAX_TO_PARAMS, rel=1e-4)
    bounds.record(found, LIVE)
    _push(bounds, "bad", 1e3)
    assert math.isinf(bounds.bound(0, 32, LIVE)), "one worker of four is not yet a reference"
    _honest_history(bounds, rounds=1)
    assert bounds.bound(0, 32, LIVE) == pytest.approx(4.0 * 1.0, rel=0.2), "the liar's norms are not the reference"


def test_a_worker_far_beyond_the_bound_push_after_push_is_quarantined_and_then_refused() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    assert not any(_push(bounds, "bad", 6.0, seed=i)[1] for i in range(3 * QUARANTINE_AFTER)), (
        "clipped, but within twice the bound: not quarantined"
    )
    results = [_push(bounds, "bad", 50.0, seed=i)[1] for i in range(QUARANTINE_AFTER)]
    assert results == [False] * (QUARANTINE_AFTER - 1) + [True]
    with pytest.raises(ProtocolError) as refused:
        bounds.check_not_quarantined("bad")
    assert refused.value.code == "quarantined"
    _push(bounds, "w0", 1.0)  # the others go on


def test_an_honest_worker_clipped_now_and_then_is_never_quarantined() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    for i in range(4 * QUARANTINE_AFTER):
        _, quarantined = _push(bounds, "w0", 50.0 if i % 2 else 1.0, seed=i)
        assert not quarantined


def test_off_takes_every_push_as_it_comes() -> None:
    bounds = GradientBounds(0.0)
    _push(bounds, "w0", 1.0)
    found, quarantined = _push(bounds, "bad", 1e9)
    assert not found.clipped and not quarantined and float(found.tensors[0].norm()) == pytest.approx(1e9)


def test_when_every_worker_is_clipped_the_model_moved_and_nobody_is_quarantined() -> None:
    bounds = GradientBounds(4.0)
    _honest_history(bounds)
    for i in range(3 * QUARANTINE_AFTER):  # a shard restored an older model: every gradient is larger at once
        for w in ("w0", "w1", "w2"):
            _, quarantined = _push(bounds, w, 50.0, seed=i)
            assert not quarantined, (i, w)
    assert not bounds.quarantined


def test_of_two_workers_neither_is_quarantined_as_no_majority_can_tell_which_one_lies() -> None:
    bounds = GradientBounds(4.0)
    live = {"w0", "bad"}
    for i in range(4 * QUARANTINE_AFTER):  # the liar pushes tiny norms: the honest worker is far beyond the bound
        for w, norm in (("bad", 1e-3), ("w0", 1.0)):
            g = torch.randn(100, generator=torch.Generator().manual_seed(i))
            found = bounds.assess(w, {0: g * (norm / float(g.norm()))}, 32, PARAMS, live, 1.0)
            assert not bounds.record(found, live)
    assert not bounds.quarantined
