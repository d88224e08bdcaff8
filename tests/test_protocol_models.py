"""The predictor's models of Ringmaster, local SGD and a round protocol's start-up (common/planning/
protocol_models.py), and `choose`'s pick on each regime's cluster file: pure functions on hand-built clusters, the
shipped cluster files, the simulator's profiles and random clusters."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from bench.auto_evidence import predictor_cluster
from dynabatch.common.planning.auto_choice import HYSTERESIS, choose
from dynabatch.common.planning.cluster_file import read_cluster
from dynabatch.common.planning.discarded_workers import discarded_workers
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.predicted_cluster import measured_node
from dynabatch.common.planning.prediction import POLICIES, Cluster, Node, predict
from dynabatch.common.planning.protocol_switch import START, SWITCHABLE
from test_prediction import random_cluster

PROFILES = Path(__file__).resolve().parent.parent / "bench" / "profiles"
GPU = Device(0.02, 0.0005)
# The method the regime study found fastest to 80% on each cluster file (bench/RESULTS.md 17 and 19): Ringmaster
# on mixed GPU generations (24 s against asgd+fixed's 32 s) and mixed links (90 s against 100 s), local SGD where one
# shard bounds the job (the only method at 80% on ps_bound64; 14 s against 50 s on cpu_gpu8).
# On ps_bound64 local+fixed ties local+dynamic (96 s each: 64 identical workers), so either policy is the study's.
STUDY_BEST = {
    "mixed_gpus16": ("ringmaster", {"fixed"}),
    "mixed_links16": ("ringmaster", {"fixed"}),
    "ps_bound64": ("local", {"fixed", "dynamic"}),
    "cpu_gpu8": ("local", {"dynamic"}),
}
# What `--protocol auto` picks at run time, among the protocols it switches among (no Ringmaster, whose threshold
# under auto's delay step only drops the slowest workers' samples), from its start on asgd + fixed: asgd + fixed
# where the study's best was Ringmaster (at the delay step asgd was as fast or faster there, bench/RESULTS.md 35 and
# 38), local SGD where it was local SGD.
AUTO_PICK = {
    "mixed_gpus16": ("asgd", {"fixed"}),
    "mixed_links16": ("asgd", {"fixed"}),
    "ps_bound64": ("local", {"fixed", "dynamic"}),
    "cpu_gpu8": ("local", {"dynamic"}),
}


def _random(seed: int) -> Cluster:
    """test_prediction's random cluster with shards that take time to serve and an H of its own."""
    rng = random.Random(seed)
    return replace(
        random_cluster(seed), shard_mbit=rng.choice([1000, 10000, 25000]), local_steps=rng.choice([1, 4, 8, 16])
    )


@pytest.mark.parametrize("seed", range(30))
def test_ringmasters_staleness_stays_below_its_threshold_and_it_applies_only_what_is_computed(seed: int) -> None:
    cluster = _random(seed)
    asgd = predict(cluster, STUDY_NOISE, "asgd", "fixed")
    for policy in POLICIES:
        ring = predict(cluster, STUDY_NOISE, "ringmaster", policy)
        busy = sum(1 for b in ring.batches if b > 0)
        assert 0 <= ring.staleness <= busy - 1 + 1e-9, "R is the workers: a gradient R versions stale is discarded"
        assert 0 <= ring.discarded < 1
    ring = predict(cluster, STUDY_NOISE, "ringmaster", "fixed")
    steps = {i: t for i, (t, b) in enumerate(zip(asgd.step_s, asgd.batches, strict=True)) if b > 0}
    idle = {i for i, d in discarded_workers(steps, len(cluster.nodes)).items() if d.always}
    assert idle == {i for i, b in enumerate(ring.batches) if b == 0}, "idle: those Ringmaster would always discard"
    assert [b for i, b in enumerate(ring.batches) if i not in idle] == [
        b for i, b in enumerate(asgd.batches) if i not in idle
    ]
    if not idle:
        computed = asgd.samples_per_s / (1 - asgd.discarded)
        assert ring.samples_per_s <= computed * (1 + 1e-9), "discarding never adds samples"
        assert ring.samples_per_s == pytest.approx(computed * (1 - ring.discarded), rel=1e-9), "both compute alike"
    else:
        assert ring.discarded < asgd.discarded, "the idle workers compute nothing to discard"


def test_ringmaster_drops_a_worker_too_slow_for_its_threshold_and_keeps_equal_ones() -> None:
    slow = Node(Device(0.2, 0.005))
    mixed = Cluster((Node(GPU),) * 3 + (slow,), 256)
    ring, asgd = predict(mixed, STUDY_NOISE, "ringmaster", "fixed"), predict(mixed, STUDY_NOISE, "asgd", "fixed")
    # the slow worker's step (0.52 s) holds 10 of each fast one's (0.052 s): 30 versions, above R = 4, so it is idle.
    # asgd counts the three fast ones too (the slow one's updates, 30 stale, cost more than they give), whose
    # staleness its rare updates still raise by 0.052 / 0.52 of a version
    assert ring.staleness == pytest.approx(2) and asgd.staleness == pytest.approx(2 + 0.052 / 0.52)
    share = (64 / 0.52) / (3 * 64 / 0.052 + 64 / 0.52)
    assert ring.batches[3] == 0 and ring.discarded == 0 and asgd.discarded == pytest.approx(share)
    assert ring.effective_batch == pytest.approx(64 * 3) and ring.time_s < asgd.time_s
    equal = Cluster((Node(GPU),) * 4, 256)
    assert predict(equal, STUDY_NOISE, "ringmaster", "fixed") == replace(
        predict(equal, STUDY_NOISE, "asgd", "fixed"), protocol="ringmaster"
    ), "equal workers: nothing is discarded, Ringmaster is asgd"


def test_asgd_counts_the_fast_workers_updates_not_a_far_slower_workers_rare_stale_ones() -> None:
    """Four workers 100x slower beside eight fast ones (behind a slow link, say) make asgd's updates no staler than
    their own rare versions do: charging every update the mean staleness (n - 1 = 11, an update worth 12 batches
    instead of 8) predicted asgd 1.5x slower than the eight alone and 1.8x slower than Ringmaster on mixed_links16,
    where the two ran level."""
    fast, slow = Node(GPU), Node(Device(2.0, 0.05))
    alone = predict(Cluster((fast,) * 8, 512), STUDY_NOISE, "asgd", "fixed")
    mixed = predict(Cluster((fast,) * 8 + (slow,) * 4, 768), STUDY_NOISE, "asgd", "fixed")
    assert mixed.staleness == pytest.approx(7 + 4 * 0.052 / 5.2), "the slow ones' versions still reach the fast ones"
    assert mixed.effective_batch == pytest.approx(64 * (1 + mixed.staleness)) and mixed.effective_batch < 64 * 12
    assert mixed.discarded == pytest.approx((4 * 64 / 5.2) / (8 * 64 / 0.052 + 4 * 64 / 5.2))
    assert alone.time_s <= mixed.time_s <= alone.time_s * 1.01
    ring = predict(Cluster((fast,) * 8 + (slow,) * 4, 768), STUDY_NOISE, "ringmaster", "fixed")
    assert ring.time_s <= mixed.time_s <= ring.time_s * (1 + HYSTERESIS), "auto keeps asgd: Ringmaster gains nothing"
    links16 = predictor_cluster(read_cluster(PROFILES / "mixed_links16.json"))
    links = {q: predict(links16, STUDY_NOISE, q, "fixed").time_s for q in ("asgd", "ringmaster")}
    assert links["asgd"] <= links["ringmaster"] * (1 + HYSTERESIS), links


@pytest.mark.parametrize("seed", range(30))
def test_local_sgds_throughput_is_bounded_by_the_shards_service_rate(seed: int) -> None:
    """A round moves every busy worker's whole model in and out of the shards once: at most H B samples per 2 n
    services."""
    cluster = _random(seed)
    for policy in POLICIES:
        local = predict(cluster, STUDY_NOISE, "local", policy)
        busy = sum(1 for b in local.batches if b > 0)
        bound = cluster.local_steps * sum(local.batches) / (2 * busy * cluster.push_service_s())
        assert local.samples_per_s <= bound * (1 + 1e-9)
        assert local.samples_per_s <= cluster.local_steps * sum(local.batches) / max(local.step_s) * (1 + 1e-9)


def test_local_sgd_moves_the_model_once_per_h_steps_so_it_leaves_a_busy_shard_behind() -> None:
    shard_bound = Cluster((Node(GPU, 10000),) * 16, 1024, 1e8, 100, 1, 10000, local_steps=8)
    service = 1e8 * 8 / 1e10
    asgd, local = (
        predict(shard_bound, STUDY_NOISE, "asgd", "fixed"),
        predict(shard_bound, STUDY_NOISE, "local", "fixed"),
    )
    assert asgd.samples_per_s == pytest.approx(64 / (2 * service))
    assert local.samples_per_s == pytest.approx(8 * 1024 / (2 * 16 * service)), "the shard is busy all the round"
    assert local.time_s < asgd.time_s / 4
    # with shards that serve at once, a round is the slowest worker's H steps and transfers
    free = replace(shard_bound, shard_mbit=0.0)
    assert predict(free, STUDY_NOISE, "local", "fixed").samples_per_s == pytest.approx(
        8 * 1024 / (8 * GPU.seconds(64) + free.transfer_s(free.nodes[0]))
    )


def test_a_round_protocol_waits_its_first_round_for_a_slow_link_before_anyone_is_measured() -> None:
    cluster = Cluster((Node(GPU, 10000),) * 7 + (Node(GPU, 10),), 512, 4.5e7, 40)
    first = cluster.transfer_s(cluster.nodes[-1]) + GPU.seconds(64)  # its step at the fixed split: 72 s of transfers
    lb_bsp = predict(cluster, STUDY_NOISE, "ssgd", "dynamic")
    assert lb_bsp.batches[-1] == 0, "once measured, LB-BSP leaves the slow link out"
    assert lb_bsp.startup_s == pytest.approx(first - max(lb_bsp.step_s), rel=0.05) and lb_bsp.startup_s > 60
    for protocol in ("asgd", "ringmaster"):
        assert predict(cluster, STUDY_NOISE, protocol, "dynamic").startup_s == 0, "nobody waits for its first step"
    local = predict(cluster, STUDY_NOISE, "local", "dynamic")
    assert local.batches[-1] >= 1 and max(local.step_s) > 70, "local keeps every worker, so each round waits for it"


@pytest.mark.parametrize("name", sorted(STUDY_BEST))
def test_auto_picks_the_protocol_the_study_found_fastest_on_each_regime_file(name: str) -> None:
    """From the file (`dynabatch plan`, `--protocol auto --cluster-profile`), among every modelled protocol: the
    study's best. At run time, among SWITCHABLE from asgd + fixed: AUTO_PICK."""
    cluster = predictor_cluster(read_cluster(PROFILES / f"{name}.json"))
    choice = choose(cluster, STUDY_NOISE)
    protocol, policies = STUDY_BEST[name]
    assert choice.protocol == protocol and choice.policy in policies, choice.reason
    at_run_time = choose(cluster, STUDY_NOISE, (START, "fixed"), SWITCHABLE)
    protocol, policies = AUTO_PICK[name]
    assert at_run_time.protocol == protocol and at_run_time.policy in policies, at_run_time.reason


def test_a_measured_workers_transfers_become_its_link_so_local_sgd_pays_them_once_a_round() -> None:
    """A job measured under asgd on a busy shard: each step's pull and push took 1 s against 0.05 s of compute.
    Given as links, local SGD's round pays them once per H steps; folded into the fixed cost it would pay H times."""
    nodes = tuple(measured_node(GPU, 1.0, 1e8) for _ in range(8))
    cluster = Cluster(nodes, 512, 1e8, 100, local_steps=8)
    assert cluster.transfer_s(nodes[0]) == pytest.approx(1.0)
    local, asgd = predict(cluster, STUDY_NOISE, "local", "fixed"), predict(cluster, STUDY_NOISE, "asgd", "fixed")
    assert local.step_s[0] == pytest.approx(8 * GPU.seconds(64) + 1.0)
    assert local.samples_per_s > 4 * asgd.samples_per_s
    folded = Cluster((Node(Device(GPU.fixed_s + 1.0, GPU.per_sample_s)),) * 8, 512, local_steps=8)
    assert predict(folded, STUDY_NOISE, "local", "fixed").samples_per_s < asgd.samples_per_s
    assert measured_node(GPU, 0.0, 1e8) == Node(GPU), "no transfer measured: no link"


@pytest.mark.parametrize("name", sorted(STUDY_BEST))
def test_a_cluster_as_measured_with_links_and_shard_rates_apart_gets_the_files_pick(name: str) -> None:
    """The contract of the run-time switch's measured cluster: each worker's compute curve, its link's own transfer
    time (`measured_node`) and the shards' rate give the pick of the cluster file itself."""
    described = predictor_cluster(read_cluster(PROFILES / f"{name}.json"))
    nodes = tuple(measured_node(n.device, described.transfer_s(n), described.model_bytes) for n in described.nodes)
    measured = replace(described, nodes=nodes)
    picked, expected = choose(measured, STUDY_NOISE), choose(described, STUDY_NOISE)
    assert (picked.protocol, picked.policy) == (expected.protocol, expected.policy), picked.reason
