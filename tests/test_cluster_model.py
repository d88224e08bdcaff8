"""The simulator's cost model (bench/cluster_model.py): each feature against its formula, alone and in a run."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench.cluster_model import Link, Network, Request, ShardQueue, Shards, chunks_of
from bench.simulate import SimConfig, SimResult, WorkerSpec, simulate
from dynabatch.common.planning.prediction import pipelined
from dynabatch.common.tasks.data import Dataset, load_dataset


@pytest.fixture(scope="module")
def data() -> Dataset:
    return load_dataset("synthetic")


def node(count: int, **kw: Any) -> tuple[WorkerSpec, ...]:
    return (WorkerSpec(**kw),) * count


def run(protocol: str, policy: str, workers: tuple[WorkerSpec, ...], data: Dataset, **kw: Any) -> SimResult:
    """A noiseless run whose only evaluation is at the end (the runs here count samples, not accuracy)."""
    base = dict(
        budget_s=20.0, global_batch=16 * len(workers), dataset="synthetic", eval_every_s=1e9, eval_size=50, noise=0.0
    )
    return simulate(SimConfig(protocol, policy, workers, **{**base, **kw}), data)


def _served_in_order(shards: Shards, count: int) -> list[tuple[float, int]]:
    """Drive shard 0's process as the simulator's event loop would, over requests already waiting: (when each
    was served, its rank) in the order served."""
    clock = [0.0]
    out: list[tuple[float, Request]] = []
    waiting = [r for _, _, r in shards.queues[0].waiting]
    server = shards.queues[0].serving(lambda: clock[0], lambda: None)
    while len(out) < count:
        what = next(server)
        out += [(clock[0], r) for r in waiting if r.done and all(r is not o for _, o in out)]
        if callable(what):
            assert what() or len(out) == count, "the shard idles while requests wait"
            continue
        clock[0] = what
    return [(t, r.rank) for t, r in out]


def test_a_link_takes_latency_plus_bits_over_bandwidth_and_a_shard_serves_the_best_ranked_then_the_earliest() -> None:
    assert Link(8.0, latency_s=0.01).transfer_s(1e6) == pytest.approx(1.01)  # 8 Mbit over 8 Mbit/s
    shards = Shards(1, 80.0, 1e6)  # 1 MB in 0.1 s
    first, ranked, second = (shards.request(rank, now=0.0) for rank in (2, 0, 2))
    order = _served_in_order(shards, 3)
    assert [t for t, _ in order] == pytest.approx([0.1, 0.2, 0.3])
    assert [rank for _, rank in order] == [0, 2, 2]
    served = shards.queues[0]
    assert served.busy_s == pytest.approx(0.3) and served.queued_s == pytest.approx(0.1 + 0.2), "as a shard reports"
    assert ranked[0].done and first[0].done and second[0].done
    assert ShardQueue(mbit=0.0).service_s(1e9) == 0.0  # no rate: served at once
    two = Shards(2, 80.0, 1e6)  # each shard serves half the model
    assert two.request(0, now=0.0)[0].nbytes == 5e5 and two.queues[1].service_s(5e5) == pytest.approx(0.05)
    assert chunks_of(3 * 2**20 + 1, 2**20) == 4
    assert pipelined(1.0, 0.3, 1) == pytest.approx(1.3) and pipelined(1.0, 0.3, 10) == pytest.approx(1.03)


def test_a_shards_service_varies_by_its_spread_around_the_same_mean_and_not_at_all_without_one() -> None:
    varied = Shards(1, 80.0, 1e6, spread=0.8, seed=5)  # 1 MB in 0.1 s on average
    draws = [varied.queues[0].drawn_service_s(1e6) for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(0.1, rel=0.03), "a factor of mean 1: the rate is kept"
    assert statistics.stdev(draws) / statistics.fmean(draws) == pytest.approx(0.8, rel=0.1)
    again = Shards(1, 80.0, 1e6, spread=0.8, seed=5).queues[0]
    assert [again.drawn_service_s(1e6) for _ in range(3)] == draws[:3], "the shard's own seeded generator"
    alike = Shards(1, 80.0, 1e6).queues[0]
    state = alike.rng.getstate()
    assert [alike.drawn_service_s(1e6) for _ in range(5)] == [alike.service_s(1e6)] * 5
    assert alike.rng.getstate() == state, "no spread draws nothing"
    for rank in range(50):
        varied.request(rank, now=0.0)
    served = [t for t, _ in _served_in_order(varied, 50)]
    gaps = [b - a for a, b in zip([0.0, *served], served, strict=False)]
    assert max(gaps) > 2 * min(gaps), "the queue's services vary one by one"


def test_a_gradient_step_overlaps_the_pull_with_forward_and_the_push_with_backward() -> None:
    net = Network(Link(8.0), Shards(1, 0.0, 1e6), chunks=4, message_s=0.0)  # 1 s each way; forward 0.2, backward 0.4
    assert net.exposed_pull_s(net.pull_s(0.0), 0.6) == pytest.approx(1.0 + 0.2 / 4 - 0.2)
    assert net.push_link_s(0.6) == pytest.approx(1.0 + 0.4 / 4 - 0.4) and net.push_link_s() == pytest.approx(1.0)
    serial = Network(Link(8.0), Shards(1, 0.0, 1e6), chunks=1, message_s=0.0)
    assert (serial.exposed_pull_s(serial.pull_s(0.0), 0.6), serial.push_link_s(0.6)) == pytest.approx((1.0, 1.0))


def test_a_push_costs_its_messages_and_its_bytes_overlapped_with_backward_and_bounded_by_its_credit() -> None:
    """ceil(chunks / group) messages of 0.01 s each beside the bytes; fewer messages overlap less with backward;
    past its first credit's worth, a credit under the bandwidth-delay product makes the link as slow as credit
    over round trip."""
    net = Network(Link(8.0), Shards(1, 0.0, 1e6), chunks=4, message_s=0.01)
    assert net.push_messages(1) == 4 and net.push_messages(3) == 2 and net.push_messages(8) == 1
    assert net.push_link_s() == pytest.approx(1.0 + 4 * 0.01)
    assert net.push_link_s(group=4) == pytest.approx(1.0 + 0.01)
    assert net.push_link_s(0.6) == pytest.approx(1.04 + 0.4 / 4 - 0.4)
    assert net.push_link_s(0.6, group=4) == pytest.approx(1.01)
    two = Network(Link(8.0), Shards(2, 0.0, 1e6), chunks=4, message_s=0.01)  # two of a shard's chunks per push
    assert two.push_messages(1) == 4 and two.push_messages(2) == 2
    far = Network(Link(8.0, latency_s=0.05), Shards(1, 0.0, 1e6), chunks=4, message_s=0.01)
    round_trip = 2 * 0.05 + 0.25  # a message of 250 kB takes 0.25 s at 1 MB/s
    assert far.push_link_s(credit=100_000) == pytest.approx(0.05 + 0.04 + 0.1 + 900_000 / (100_000 / round_trip))
    assert far.push_link_s(credit=10**9) == pytest.approx(far.push_link_s())


@pytest.mark.parametrize("pipeline, wire_bytes", [("off", 1e6), ("auto", 8e6)])
def test_a_workers_samples_follow_its_own_curve_and_the_models_bytes_over_its_link(
    data: Dataset, pipeline: str, wire_bytes: float
) -> None:
    """One worker, its step 0.1 + 0.01 b s, pulling and pushing the model over its link: the samples it trains
    in the budget are the budget over the step's formula (serial, or overlapped over 8 chunks)."""
    link_mbit = 8.0 * wire_bytes / 1e6  # one second each way
    worker = node(1, fixed_s=0.1, per_sample_s=0.01, link_mbit=link_mbit, latency_s=0.005)
    r = run("asgd", "fixed", worker, data, wire_bytes=wire_bytes, job={"pipeline": pipeline})
    compute, transfer = 0.1 + 0.01 * 16, 1.005
    if pipeline == "off":
        step = transfer + compute + transfer
    else:
        k, forward, backward = 8, compute / 3, 2 * compute / 3
        step = (
            (max(transfer, forward) + min(transfer, forward) / k - forward)
            + compute
            + (max(backward, transfer) + min(backward, transfer) / k - backward)
        )
    assert abs(r.samples - 16 * 20.0 / step) <= 16  # within the step the budget cuts


def test_many_workers_pushing_a_large_model_queue_at_the_shard_and_more_shards_serve_them_faster(data: Dataset) -> None:
    """Eight fast workers on fast links, a 1 MB model and shards of 80 Mbit/s: every step is a pull and a push
    the shards must serve (0.1 s each for one shard), so the job trains 5 steps/s whatever the workers could do,
    and four shards (a quarter of the model each) serve four times as many. The budget cuts at most one step of
    each worker."""
    workers = node(8, fixed_s=0.001, per_sample_s=1e-5, link_mbit=10_000.0)
    for shards in (1, 4):
        r = run("asgd", "fixed", workers, data, budget_s=30.0, wire_bytes=1e6, shard_mbit=80.0, shards=shards)
        assert abs(r.samples - 16 * 5.0 * shards * 30.0) <= 8 * 16


@pytest.mark.parametrize("policy", ["fixed", "dynamic"])
def test_no_worker_is_given_more_than_its_memory_cap_and_the_global_batch_goes_to_the_others(
    data: Dataset, policy: str
) -> None:
    """Two fast workers capped at 20 samples beside two slow ones: the dynamic split would give the fast ones
    about 50 each and the fixed one 32; the cap holds and the rest of B = 128 goes to the uncapped."""
    fast = node(2, fixed_s=0.01, per_sample_s=0.0005, max_batch=20, link_mbit=10_000.0)
    slow = node(2, fixed_s=0.01, per_sample_s=0.002, link_mbit=10_000.0)
    r = run("asgd", policy, fast + slow, data, budget_s=5.0, global_batch=128)
    assert r.worker_batches["sim0"] == r.worker_batches["sim1"] == 20
    assert sum(r.worker_batches.values()) == 128


def test_a_fixed_part_in_the_slowdown_adds_its_seconds_to_every_simulated_step(data: Dataset) -> None:
    """`--slowdown F:A` as the real worker idles it: a step of the cluster's curve times F, plus A."""
    worker = (WorkerSpec("2:0.1"),)
    r = run("asgd", "fixed", worker, data, fixed_s=0.01, per_sample_s=0.001, comm_s=0.0)
    step = (0.01 + 0.001 * 16) * 2 + 0.1
    assert abs(r.samples - 16 * 20.0 / step) <= 16


def test_a_scheduled_round_serves_its_critical_worker_first_at_a_busy_shard_and_its_plan_follows_its_link(
    data: Dataset,
) -> None:
    """ssgd, fixed batches, one shard that takes 0.5 s per pull or push: a worker computing 1 s beside one
    computing 0.1 s that asks first. Served in arrival order the slow one's pull waits for the fast one's and a
    round takes 2.5 s (pulls 0.5 + 0.5, its compute 1, its push behind the fast one's 0.5); ranked, the slow
    one (the round's longest own step) is served first and a round takes 2.1 s. The simulated heartbeats report
    the bytes each step moved, from which the scheduler plans each worker's pushes (`fixed`: one chunk each)."""
    fast = WorkerSpec(fixed_s=0.1, per_sample_s=0.0, link_mbit=100_000.0)
    slow = WorkerSpec(fixed_s=1.0, per_sample_s=0.0, link_mbit=100_000.0)
    rounds = {}
    for schedule in ("fixed", "scheduled"):
        r = run(
            "ssgd",
            "fixed",
            (fast, slow),
            data,
            budget_s=60.0,
            wire_bytes=1e6,
            shard_mbit=16.0,
            job={"chunk_schedule": schedule, "pipeline": "off", "chunk_bytes": 4096},
        )
        rounds[schedule] = r.samples / 32
        groups = {group for group, _ in r.worker_wire.values()}
        # about 2 MB/s measured: pushes of sqrt(overhead x rate x 1 MB) = 20 kB, four chunks of 4 KiB
        assert groups == ({1} if schedule == "fixed" else {4}), r.worker_wire
    assert abs(rounds["fixed"] - 60.0 / 2.5) <= 1.5
    assert abs(rounds["scheduled"] - 60.0 / 2.1) <= 1.5


def test_a_scheduled_round_bounded_by_one_slow_link_brings_the_next_model_down_while_its_gradient_goes_up(
    data: Dataset,
) -> None:
    """ssgd, pipelined steps of 10 ms, a 1 MB model in four chunks; one worker behind 8 Mbit/s (1 s a direction).
    Under `fixed` the slow worker pulls only once its push is acknowledged: a round is its push and its pull, 2 s.
    Under `scheduled` its next pull left with its push and each chunk came down as its round closed, while the
    rest went up: the round is its push and the last chunk down, 1.25 s (Network.pull_s)."""
    fast = WorkerSpec(fixed_s=0.01, per_sample_s=0.0, link_mbit=100_000.0)
    slow = WorkerSpec(fixed_s=0.01, per_sample_s=0.0, link_mbit=8.0)
    rounds = {}
    for schedule in ("fixed", "scheduled"):
        job = {"chunk_schedule": schedule, "pipeline": "on", "chunk_bytes": 262144}
        rounds[schedule] = run("ssgd", "fixed", (fast, slow), data, budget_s=60.0, wire_bytes=1e6, job=job).samples / 32
    assert abs(rounds["fixed"] - 60.0 / 2.0) <= 1.5
    assert abs(rounds["scheduled"] - 60.0 / 1.25) <= 1.5
    net = Network(Link(8.0), Shards(1, 0.0, 1e6), chunks=4)
    assert net.pull_s(0.0, ahead_s=0.5) == pytest.approx(0.5) and net.pull_s(0.0, ahead_s=2.0) == pytest.approx(0.25)
