"""The round aggregations (ps/aggregation.py) directly, in the shard's round rules, and the flags that choose them.

One wild contribution among n honest ones: the mean follows it as far as it goes, the trimmed mean and the median
stay within the honest values of each coordinate. Identical contributions give the mean; the order they come in
changes no bit; finite values never give NaN or inf.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from dynabatch import optim as optim_spec
from dynabatch.common.config import JobConfig, job_from_dict, to_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.protocols import SPECS, OuterSettings, RoundSettings, SoftsyncSettings, protocol_settings
from dynabatch.common.wire.chunking import make_layout
from dynabatch.ps.aggregation import aggregate, trimmed_count, trimmed_mean, weighted_mean
from dynabatch.ps.shard_state import ShardState
from hang_guard import hang_guard_s

MEAN, TRIMMED, MEDIAN = RoundSettings(), RoundSettings(aggregation="trimmed-mean"), RoundSettings(aggregation="median")
ROBUST = [TRIMMED, MEDIAN]


def _honest(n: int, size: int = 200, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=gen), 16 + 8 * i) for i in range(n)]


@pytest.mark.parametrize("honest", [2, 3, 4, 7])
@pytest.mark.parametrize("settings", ROBUST, ids=lambda s: s.aggregation)
def test_one_wild_contribution_moves_the_mean_arbitrarily_and_the_robust_rules_only_within_the_honest_values(
    honest: int, settings: RoundSettings
) -> None:
    parts = _honest(honest)
    values = torch.stack([t for t, _ in parts])
    low, high = values.min(dim=0).values, values.max(dim=0).values
    most = max(samples for _, samples in parts)
    for scale in (1e3, 1e6, 1e30):
        wild = torch.full((200,), scale) * torch.sign(torch.randn(200, generator=torch.Generator().manual_seed(9)))
        attacked = [*parts, (wild, most)]  # the liar claims as many samples as the largest honest batch
        assert weighted_mean(attacked).abs().min() > scale / (honest + 1) / 2, "the mean follows the liar"
        robust = aggregate(attacked, settings)
        assert torch.all(robust >= low) and torch.all(robust <= high), f"{settings.aggregation} left the honest range"


@pytest.mark.parametrize("settings", [MEAN, *ROBUST], ids=lambda s: s.aggregation)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_identical_contributions_give_the_mean_whatever_their_samples(settings: RoundSettings, n: int) -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(n))
    parts = [(x.clone(), 5 + 11 * i) for i in range(n)]
    torch.testing.assert_close(aggregate(parts, settings), weighted_mean(parts))
    torch.testing.assert_close(aggregate(parts, settings), x)


@pytest.mark.parametrize("settings", ROBUST, ids=lambda s: s.aggregation)
def test_the_order_of_the_contributions_changes_nothing_even_among_ties(settings: RoundSettings) -> None:
    """Values drawn from a few integers, so coordinates tie, with unequal samples that a tie must not reorder:
    the values kept are the same in every order, so the result is the same up to its sum's rounding."""
    gen = torch.Generator().manual_seed(4)
    parts = [(torch.randint(-2, 3, (500,), generator=gen).float() / 3, samples) for samples in (3, 50, 7, 50, 12)]
    results = [aggregate(list(order), settings) for order in itertools.permutations(parts)]
    for result in results:
        torch.testing.assert_close(result, results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("settings", [MEAN, *ROBUST], ids=lambda s: s.aggregation)
def test_finite_contributions_never_give_nan_or_inf(settings: RoundSettings) -> None:
    big = torch.finfo(torch.float32).max
    extremes = torch.tensor([big, -big, 0.0, -0.0, 1e-45, big / 3])
    for picks in itertools.product(range(len(extremes)), repeat=3):
        parts = [(extremes[list(picks)].roll(i), samples) for i, samples in enumerate((1, 4096, 7))]
        assert torch.isfinite(aggregate(parts, settings)).all(), [p[0] for p in parts]


def test_the_median_of_fewer_than_three_is_the_mean_and_of_an_even_count_the_weighted_mean_of_the_middle_two() -> None:
    parts = _honest(2)
    assert torch.equal(aggregate(parts[:1], MEDIAN), weighted_mean(parts[:1]))
    assert torch.equal(aggregate(parts, MEDIAN), weighted_mean(parts))
    four = [(torch.tensor([v]), s) for v, s in ((0.0, 1), (1.0, 10), (3.0, 30), (100.0, 1))]
    torch.testing.assert_close(aggregate(four, MEDIAN), torch.tensor([(1.0 * 10 + 3.0 * 30) / 40]))
    five = [*four, (torch.tensor([-50.0]), 1000)]
    torch.testing.assert_close(aggregate(five, MEDIAN), torch.tensor([1.0]), msg="the middle worker, whatever b")


def test_the_trimmed_mean_drops_by_worker_per_coordinate_and_weighs_the_kept_by_samples() -> None:
    """Against a reference computed coordinate by coordinate in plain Python."""
    parts = _honest(7, size=50, seed=3)
    k = 2
    got = trimmed_mean(parts, k)
    for j in range(50):
        kept = sorted((float(t[j]), s) for t, s in parts)[k:-k]
        expected = sum(v * s for v, s in kept) / sum(s for _, s in kept)
        assert math.isclose(float(got[j]), expected, rel_tol=1e-5, abs_tol=1e-6)
    with pytest.raises(ValueError, match="cannot drop 2 of 4"):
        trimmed_mean(parts[:4], 2)


@pytest.mark.parametrize(
    "workers, trim, k",
    [
        (2, 0.2, 0),
        (3, 0.2, 1),
        (4, 0.2, 1),
        (5, 0.2, 1),
        (6, 0.2, 2),
        (10, 0.3, 3),
        (10, 0.49, 4),
        (5, 0.49, 2),
        (20, 0.05, 1),
    ],
)
def test_the_trim_is_rounded_up_to_whole_workers_and_keeps_at_least_one(workers: int, trim: float, k: int) -> None:
    assert trimmed_count(workers, trim) == k


# The rules on the shard: a liar among three workers, its gradient 1e6 times an honest one.

SGD = optim_spec.SGD(lr=0.1, momentum=0.0, weight_decay=0.0)
B = 48


def _shard(protocol: str, settings: RoundSettings) -> ShardState:
    state = ShardState.initial(make_layout(64, 1024, 1).chunks, torch.zeros(64), SGD, protocol, B, settings)
    state.set_membership({"a", "b", "c", "liar"}, allocated=4)
    return state


def _step(state: ShardState, pushes: list[tuple[str, torch.Tensor, int]]) -> torch.Tensor:
    """Push each (worker, gradient, samples) at version 0; the parameters' change, over -lr: the applied update."""
    before = state.params[0].clone()
    for worker, grad, samples in pushes:
        state.push(worker, {0: grad}, {0: 0}, samples, state.kind, 0.0)
    assert state.chunk_versions[0] == 1, "the round closed once"
    return (state.params[0] - before) / -SGD.lr


def _honest_and_liar() -> tuple[list[tuple[str, torch.Tensor, int]], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    honest = [(name, torch.randn(64, generator=gen), 12) for name in ("a", "b", "c")]
    values = torch.stack([g for _, g, _ in honest])
    return honest, values.min(dim=0).values, values.max(dim=0).values


@pytest.mark.parametrize("protocol", ["ssgd", "rennala"])
def test_a_round_of_ssgd_or_rennala_with_a_liar_applies_an_update_within_the_honest_values(protocol: str) -> None:
    honest, low, high = _honest_and_liar()
    pushes = [*honest, ("liar", torch.full((64,), 1e6), 12)]
    assert _step(_shard(protocol, MEAN), pushes).min() > 1e5, "the mean takes the liar's step"
    update = _step(_shard(protocol, MEDIAN), pushes)
    assert torch.all(update >= low - 1e-5) and torch.all(update <= high + 1e-5)


def test_a_fast_liar_pushing_twice_into_a_softsync_round_is_one_worker_of_its_median() -> None:
    """c = floor(4 / 1) = 4 pushes close the round: two of them the liar's. Pooled per worker, the median is of
    three honest values and one wild one; counted per push it would be the liar's."""
    honest, low, high = _honest_and_liar()
    wild = torch.full((64,), 1e6)
    pushes = [honest[0], ("liar", wild, 12), ("liar", wild, 12), honest[1]]
    state = _shard("softsync", SoftsyncSettings(1, aggregation="median"))
    update = _step(state, pushes)
    pair = torch.stack([honest[0][1], honest[1][1]])
    assert torch.all(update >= pair.min(dim=0).values - 1e-5) and torch.all(update <= pair.max(dim=0).values + 1e-5)


def test_local_sgds_outer_rule_takes_the_median_of_the_deltas() -> None:
    honest, low, high = _honest_and_liar()
    state = ShardState.initial(
        make_layout(64, 1024, 1).chunks, torch.zeros(64), SGD, "local", B, OuterSettings(aggregation="median")
    )
    state.set_membership({"a", "b", "c", "liar"}, allocated=4)
    for worker, delta, samples in [*honest, ("liar", torch.full((64,), -1e6), 12)]:
        state.push(worker, {0: delta}, {0: 0}, samples, state.kind, 0.0)
    moved = state.params[0]  # plain averaging (outer lr 1, no momentum): the parameters move by the aggregate
    assert torch.all(moved.abs() <= torch.maximum(low.abs(), high.abs()) + 1e-5)


# The flags: owned by the round protocols' settings, carried to the shard in the job, refused elsewhere.


@pytest.mark.parametrize("protocol", [name for name, spec in SPECS.items() if spec.closes_rounds])
def test_the_aggregation_reaches_every_round_protocols_settings_through_the_jobs_description(protocol: str) -> None:
    job = JobConfig(protocol=protocol, aggregation="trimmed-mean", trim=0.3)
    job.validate()
    settings = protocol_settings(job_from_dict(to_dict(job)))  # as WELCOME carries the job to a shard
    assert isinstance(settings, RoundSettings)
    assert (settings.aggregation, settings.trim) == ("trimmed-mean", 0.3)


def test_the_round_protocols_are_those_that_close_rounds() -> None:
    assert {name for name, spec in SPECS.items() if spec.closes_rounds} == {
        "ssgd",
        "msync",
        "softsync",
        "rennala",
        "local",
        "msd",
    }


@pytest.mark.parametrize("protocol", [name for name, spec in SPECS.items() if not spec.closes_rounds])
def test_a_protocol_without_rounds_refuses_a_robust_aggregation_or_a_trim(protocol: str) -> None:
    with pytest.raises(ConfigError, match=f"--aggregation median: protocol {protocol} .* closes no rounds"):
        JobConfig(protocol=protocol, aggregation="median").validate()
    with pytest.raises(ConfigError, match=f"--trim 0.3: protocol {protocol}"):
        JobConfig(protocol=protocol, trim=0.3).validate()
    JobConfig(protocol=protocol, aggregation="mean").validate()


@pytest.mark.parametrize(
    "trim, needle",
    [
        (0.5, "must be below 0.5"),
        (0.7, "must be below 0.5"),
        (0.0, "must be above 0"),
        (-0.1, "must be above 0"),
        (math.nan, "not a finite number"),
        (math.inf, "not a finite number"),
    ],
)
def test_a_trim_outside_0_to_one_half_is_refused(trim: float, needle: str) -> None:
    with pytest.raises(ConfigError, match=f"--trim: .*{needle}"):
        JobConfig(protocol="ssgd", aggregation="trimmed-mean", trim=trim).validate()


def test_a_trim_without_the_trimmed_mean_is_refused_as_unread() -> None:
    with pytest.raises(ConfigError, match="--trim 0.1: only --aggregation trimmed-mean reads it, not median"):
        JobConfig(protocol="ssgd", aggregation="median", trim=0.1).validate()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--protocol", "asgd", "--aggregation", "median"], "--aggregation median: protocol asgd"),
        (["scheduler", "--protocol", "ssgd", "--aggregation", "trimmed-mean", "--trim", "nan"], "--trim: nan"),
    ],
)
def test_the_command_line_refuses_it_in_one_line_with_exit_2(args: list[str], needle: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        env=dict(os.environ),
    )
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2, out.stderr  # the short usage line, then the error
