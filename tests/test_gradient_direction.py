"""ps/gradient_direction.py: a worker whose pushes keep opposing most other workers' directions is quarantined.

The workers' gradients here are a shared true direction plus noise of their own,
the noise larger for a smaller batch (as a mean over fewer samples), so that
honest workers agree only on average, as real ones do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.gradient_bounds import GradientBounds
from dynabatch.ps.gradient_direction import LEAD, MIN_SCORED, SKETCH, WARM_PUSHES, GradientDirection

SIZE = 1000


class Workers:
    """Synthetic pushes: `truth` plus noise of `noise[w]` per value times the truth's scale, negated for liars."""

    def __init__(self, noise: dict[str, float], liars: tuple[str, ...] = (), size: int = SIZE, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.truth = torch.randn(size, generator=self.gen)
        self.noise, self.liars = noise, liars
        self.live = set(noise)

    def push(self, worker: str, signal: float = 1.0) -> dict[int, torch.Tensor]:
        g = signal * self.truth + self.noise[worker] * torch.randn(self.truth.numel(), generator=self.gen)
        return {0: -g if worker in self.liars else g}


def _rounds(
    check: GradientDirection,
    workers: Workers,
    rounds: int,
    pushes_per_round: dict[str, int] | None = None,
    signal: float = 1.0,
) -> list[tuple[str, int]]:
    """Push `rounds` rounds (each worker `pushes_per_round[w]` times, default once); the (worker, round) of each
    quarantine, which takes the worker out of the live set as the scheduler would."""
    found = []
    for r in range(rounds):
        for worker, times in (pushes_per_round or {w: 1 for w in workers.noise}).items():
            for _ in range(times):
                if worker in workers.live and check.record(worker, workers.push(worker, signal), workers.live):
                    found.append((worker, r))
                    workers.live.discard(worker)
                    check.forget(workers.live)
    return found


def test_a_sign_flipped_worker_among_honest_ones_of_unequal_batches_is_quarantined_and_no_honest_one_is() -> None:
    # Noise 3 and 6 per value: each honest push's cosine with the truth is only about 0.3 and 0.16.
    workers = Workers({"w0": 3.0, "w1": 6.0, "w2": 3.0, "liar": 3.0}, liars=("liar",))
    found = _rounds(GradientDirection(True), workers, 300)
    # Its agreements start at 0 and move 1/32 of the way to about -0.3 per push: past -0.2 after about 36 pushes,
    # which come after the others' WARM_PUSHES (30 seeds: rounds 49 to 61).
    assert found and found[0][0] == "liar" and found[0][1] < 6 * MIN_SCORED, found
    assert found == [found[0]], f"honest workers quarantined: {found[1:]}"


def test_one_liar_in_three_whose_direction_cancels_an_honest_ones_reference_is_caught_and_only_it() -> None:
    # The hard case for a mean-of-others reference: an honest worker's others are one honest and one flipped.
    workers = Workers({"w0": 2.5, "w1": 2.5, "liar": 2.5}, liars=("liar",))
    assert [w for w, _ in _rounds(GradientDirection(True), workers, 400)] == ["liar"]
    assert workers.live == {"w0", "w1"}


def test_a_liar_pushing_four_times_as_often_is_caught_and_steers_no_honest_verdict() -> None:
    workers = Workers({"w0": 3.0, "w1": 3.0, "liar": 3.0}, liars=("liar",))
    found = _rounds(GradientDirection(True), workers, 300, {"w0": 1, "w1": 1, "liar": 4})
    assert [w for w, _ in found] == ["liar"]


def test_honest_workers_are_never_quarantined_however_noisy_and_when_the_gradient_is_all_noise() -> None:
    # Training near its end: the true gradient fades to nothing, each push's direction is the noise of its batch.
    workers = Workers({f"w{i}": 2.0 * (1 + i % 3) for i in range(6)})
    check = GradientDirection(True)
    assert _rounds(check, workers, 200) == []
    assert _rounds(check, workers, 800, signal=0.0) == [], check.summary()


def test_two_workers_cannot_be_told_apart_so_neither_is_quarantined() -> None:
    workers = Workers({"w0": 2.0, "liar": 2.0}, liars=("liar",))
    assert _rounds(GradientDirection(True), workers, 300) == []


def test_every_worker_turning_at_once_is_the_model_moving_not_a_liar() -> None:
    """A shard restored from an older checkpoint: every worker's gradient changes at once; nobody is quarantined."""
    workers = Workers({f"w{i}": 2.0 for i in range(4)})
    check = GradientDirection(True)
    assert _rounds(check, workers, 100) == []
    workers.truth = -workers.truth
    assert _rounds(check, workers, 100) == [], check.summary()


def test_a_noise_liar_of_honest_size_is_not_the_direction_checks_to_catch() -> None:
    """Orthogonal to the truth, on average neither with nor against anyone (the norm bound keeps its size honest)."""
    workers = Workers({"w0": 3.0, "w1": 3.0, "w2": 3.0, "noise": 1e6})
    assert _rounds(GradientDirection(True), workers, 300) == []


def test_a_chunk_larger_than_the_sketch_is_compared_on_fixed_coordinates_and_its_liar_caught() -> None:
    workers = Workers({"w0": 3.0, "w1": 3.0, "w2": 3.0, "liar": 3.0}, liars=("liar",), size=4 * SKETCH)
    check = GradientDirection(True)
    assert [w for w, _ in _rounds(check, workers, 200)] == ["liar"]
    again = GradientDirection(True)
    again.record("w0", workers.push("w0"), workers.live)
    index, index_again = check.index[0], again.index[0]
    assert index is not None and index_again is not None
    assert index.numel() == SKETCH and torch.equal(index_again, index), "the same coordinates on every shard start"


def test_a_worker_that_left_is_no_ones_reference_and_off_records_nothing() -> None:
    workers = Workers({"w0": 1.0, "w1": 1.0, "w2": 1.0})
    check = GradientDirection(True)
    _rounds(check, workers, 20)
    check.forget({"w0", "w1"})
    assert check.workers["w2"].ref == {} and "w2" in check.summary()
    off = GradientDirection(False)
    assert not off.record("w0", workers.push("w0"), workers.live) and off.workers == {}


def test_a_worker_quarantined_for_its_direction_is_refused_saying_why() -> None:
    bounds = GradientBounds(4.0)
    bounds.quarantine("liar", "pointing against the other workers' gradients (--direction-check)")
    with pytest.raises(ProtocolError, match="quarantined.*pointing against the other workers'") as exc:
        bounds.check_not_quarantined("liar")
    assert exc.value.code == "quarantined"


def _paced(
    check: GradientDirection, workers: Workers, rounds: int, pushes_per_round: dict[str, int]
) -> dict[str, list[Any]]:
    """As the shard serves pushes: each is held (scored, not taken) while `check.held` says so, else taken.
    Per round, each worker's taken pushes and whether it was held; the quarantined workers leave the live set."""
    taken: dict[str, int] = dict.fromkeys(workers.noise, 0)
    trace: dict[str, list[Any]] = {"taken": [], "held": [], "quarantined": []}
    for r in range(rounds):
        held_now = set()
        for worker, times in pushes_per_round.items():
            for _ in range(times):
                if worker not in workers.live:
                    continue
                hold = check.held(worker, workers.live) is not None
                held_now |= {worker} if hold else set()
                taken[worker] += not hold
                if check.record(worker, workers.push(worker), workers.live, taken=not hold):
                    trace["quarantined"].append((worker, r))
                    workers.live.discard(worker)
                    check.forget(workers.live)
        trace["taken"].append(dict(taken))
        trace["held"].append(held_now)
    return trace


def test_a_liar_pushing_ten_times_as_often_at_the_start_is_held_to_the_others_pace_until_it_is_caught() -> None:
    # The job's start on a loaded machine: the honest workers get a push in for every ten of the liar's.
    workers = Workers({"w0": 3.0, "w1": 3.0, "liar": 3.0}, liars=("liar",))
    check = GradientDirection(True)
    trace = _paced(check, workers, 60, {"w0": 1, "w1": 1, "liar": 10})
    assert [w for w, _ in trace["quarantined"]] == ["liar"], trace["quarantined"]
    caught = trace["quarantined"][0][1]
    for taken in trace["taken"]:
        assert taken["liar"] <= min(taken["w0"], taken["w1"]) + LEAD + 10, taken
    # Its held pushes are scored at the pace it pushes: judged within a few honest rounds of their warming up.
    assert caught < WARM_PUSHES + MIN_SCORED, trace["quarantined"]
    assert trace["taken"][-1]["liar"] <= caught + LEAD + 10
    held = check.workers["liar"].pushes - check.workers["liar"].taken
    assert held > 0 and f"liar ({held} pushes held)" in check.summary(), check.summary()


def test_an_honest_worker_ten_times_faster_is_held_only_until_it_is_vouched_for_then_runs_free() -> None:
    workers = Workers({"w0": 3.0, "w1": 3.0, "fast": 3.0})
    trace = _paced(GradientDirection(True), workers, 40, {"w0": 1, "w1": 1, "fast": 10})
    assert trace["quarantined"] == []
    last_held = max(r for r, held in enumerate(trace["held"]) if "fast" in held)
    assert last_held < WARM_PUSHES + 2 * MIN_SCORED / 10 + 2, last_held
    assert not trace["held"][-1] and trace["taken"][-1]["fast"] > 8 * trace["taken"][-1]["w0"], trace["taken"][-1]
    assert all("w0" not in held and "w1" not in held for held in trace["held"]), "the slow ones are never held"


def test_a_newcomer_starts_level_with_the_slowest_and_holds_nobody_back() -> None:
    # Two workers train (nothing held: with one other, nothing could judge them); a third joins 30 pushes later.
    # Counted from zero, it held both back, unvouched as they were, until it caught up with them.
    workers = Workers({"w0": 3.0, "w1": 3.0, "new": 3.0})
    check = GradientDirection(True)
    workers.live = {"w0", "w1"}
    _paced(check, workers, 30, {"w0": 1, "w1": 1})
    workers.live.add("new")
    trace = _paced(check, workers, 5, {"w0": 1, "w1": 1, "new": 1})
    assert not any(trace["held"]), trace["held"]
    # It is held, as any unvouched worker, once it runs LEAD pushes ahead of the slowest of them.
    fast = _paced(check, workers, 1, {"new": LEAD + 2})
    assert fast["held"] == [{"new"}] and fast["taken"][-1]["new"] == LEAD, fast["taken"]


def test_nothing_is_held_where_nothing_could_judge_or_the_check_is_off() -> None:
    two = Workers({"w0": 3.0, "fast": 3.0})
    assert not any(_paced(GradientDirection(True), two, 10, {"w0": 1, "fast": 10})["held"])
    three = Workers({"w0": 3.0, "w1": 3.0, "fast": 3.0})
    assert not any(_paced(GradientDirection(False), three, 10, {"w0": 1, "w1": 1, "fast": 10})["held"])
