"""The predictor of a method's time to target (common/planning/prediction.py) and `auto`'s choice by it
(common/planning/auto_choice.py): pure functions, checked directly on hand-built clusters, every shipped cluster file
and the simulator's built-in profiles."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from bench.reference_time import device_of
from bench.simulate import PROFILES, SimConfig
from dynabatch.common.planning.auto_choice import HYSTERESIS, choice_of, choosable, choose
from dynabatch.common.planning.cluster_file import read_cluster
from dynabatch.common.planning.optimum import STUDY_NOISE, Device
from dynabatch.common.planning.prediction import (
    POLICIES,
    PROTOCOLS,
    Cluster,
    Node,
    cluster_of,
    optimum,
    predict,
    predict_all,
)
from dynabatch.common.planning.protocol_models import MODELS

FILES = sorted(Path(__file__).resolve().parent.parent.joinpath("bench", "profiles").glob("*.json"))
GPU = Device(0.02, 0.0005)


def _files() -> dict[str, Cluster]:
    return {p.stem: cluster_of(read_cluster(p), 1024, 1 << 20) for p in FILES}


def _builtin(name: str) -> Cluster:
    """A simulator profile's starting workers at the simulator's default curve (transfers: its constant comm_s,
    not a link, so none counted)."""
    sim = SimConfig("asgd", "fixed", ())
    nodes = tuple(Node(device_of(w, sim.fixed_s, sim.per_sample_s)) for w in PROFILES[name]() if w.join_s == 0)
    return Cluster(nodes, sim.global_batch)


def random_cluster(seed: int) -> Cluster:
    """A cluster of 1 to 24 workers drawn from `seed`: curves, caps, links (0: not counted), model, chunks, shards."""
    rng = random.Random(seed)
    nodes = tuple(
        Node(
            Device(rng.uniform(0, 0.05), rng.uniform(1e-5, 1e-3), rng.choice([0, 16, 64, 256])),
            rng.choice([0, 10, 100, 1000, 10000]),
            rng.uniform(0, 0.001),
        )
        for _ in range(rng.randint(1, 24))
    )
    return Cluster(
        nodes,
        rng.choice([32, 192, 1024, 4096]),
        rng.uniform(1e4, 1e8),
        rng.randint(1, 30),
        rng.randint(1, 4),
        rng.choice([0, 1000, 10000]),
    )


def test_a_round_that_waits_for_a_10x_slow_worker_is_predicted_behind_asynchronous_steps() -> None:
    cluster = Cluster((Node(GPU),) * 3 + (Node(Device(0.2, 0.005)),), 256)
    ssgd, asgd = predict(cluster, STUDY_NOISE, "ssgd", "fixed"), predict(cluster, STUDY_NOISE, "asgd", "fixed")
    assert ssgd.time_s > 2 * asgd.time_s
    assert max(ssgd.step_s) == pytest.approx(0.2 + 0.005 * 64)
    # sizing each worker's batch for equal steps takes most of the synchronous round's loss back
    assert predict(cluster, STUDY_NOISE, "ssgd", "dynamic").time_s < 0.5 * ssgd.time_s


def test_batches_respect_each_workers_cap_and_sum_to_the_global_batch() -> None:
    cluster = Cluster((Node(Device(0.01, 0.001, 16)), Node(GPU), Node(GPU)), 200)
    for protocol in PROTOCOLS:
        for policy in POLICIES:
            p = predict(cluster, STUDY_NOISE, protocol, policy)
            assert p.batches[0] <= 16 + 1e-9, (protocol, policy, p.batches)
            split = POLICIES[policy](cluster, MODELS[protocol])
            idle = MODELS[protocol].idle(cluster, split)  # Ringmaster's idle workers keep none of their share
            assert sum(p.batches) + sum(split[i] for i in idle) == pytest.approx(200, rel=1e-6)
    assert predict(cluster, STUDY_NOISE, "asgd", "fixed").batches == pytest.approx((16, 92, 92))
    starved = Cluster((Node(Device(0.01, 0.001, 8)),) * 2, 64)  # caps below B: every worker at its cap
    assert predict(starved, STUDY_NOISE, "ssgd", "fixed").batches == (8, 8)


def test_dynamic_batches_give_equal_steps_under_a_round_and_follow_speed_otherwise() -> None:
    cluster = Cluster((Node(GPU), Node(Device(0.005, 0.002), link_mbit=1000)), 256, model_bytes=1e6, chunks=4)
    sync = predict(cluster, STUDY_NOISE, "ssgd", "dynamic")
    assert sync.step_s[0] == pytest.approx(sync.step_s[1], rel=1e-6) and min(sync.batches) > 0
    # a worker whose transfers alone outlast the others' whole step gets no batch in a round
    remote = replace(cluster, nodes=(Node(GPU), Node(Device(0.005, 0.002), link_mbit=10)))
    assert predict(remote, STUDY_NOISE, "ssgd", "dynamic").batches == pytest.approx((256, 0))
    speeds = [n.device.speed(128) for n in cluster.nodes]
    asgd = predict(cluster, STUDY_NOISE, "asgd", "dynamic")
    assert asgd.batches[0] / asgd.batches[1] == pytest.approx(speeds[0] / speeds[1], rel=1e-6)


def test_a_dynamic_split_gives_a_worker_that_holds_a_batch_at_least_the_jobs_least_batch() -> None:
    """As the scheduler's split does (--min-batch): a slow CPU among GPUs that equal steps would give a few samples
    holds eight, and local SGD's rounds wait for its eight local steps of eight (fresh8282-6's miss, RESULTS 60);
    a round that may leave it out still gives it none, and asgd's split by speed floors it too."""
    cpu = Node(Device(0.0066, 0.011))
    nodes = (*[Node(Device(0.0216, 0.000563, 64), link_mbit=10000)] * 6, *[cpu] * 4)
    one = Cluster(nodes, 272, model_bytes=22e6, chunks=21, shards=2, shard_mbit=10000)
    eight = replace(one, min_batch=8)
    local_one, local_eight = (
        predict(one, STUDY_NOISE, "local", "dynamic"),
        predict(eight, STUDY_NOISE, "local", "dynamic"),
    )
    assert local_one.batches[-1] < 8.0 and local_eight.batches[-1] == 8.0
    assert local_eight.samples_per_s < local_one.samples_per_s, "the round waits for the CPUs' eight steps of eight"
    assert predict(eight, STUDY_NOISE, "ssgd", "dynamic").batches[-1] in (0.0, 8.0)
    assert min(b for b in predict(eight, STUDY_NOISE, "asgd", "dynamic").batches) == 8.0
    assert sum(predict(eight, STUDY_NOISE, "asgd", "dynamic").batches) == pytest.approx(272)
    with pytest.raises(ValueError, match="least batch"):
        replace(one, min_batch=0)


def test_a_slower_link_never_makes_a_method_faster_and_more_shards_relieve_a_busy_one() -> None:
    base = Cluster((Node(GPU, 10000),) * 8, 512, model_bytes=4e7, chunks=10)
    slow_link = replace(base, nodes=(Node(GPU, 1000),) + base.nodes[1:])
    one_shard, four_shards = replace(base, shard_mbit=10000), replace(base, shard_mbit=10000, shards=4)
    for protocol in PROTOCOLS:
        for policy in POLICIES:
            t = predict(base, STUDY_NOISE, protocol, policy).time_s
            assert predict(slow_link, STUDY_NOISE, protocol, policy).time_s >= t
            busy = predict(one_shard, STUDY_NOISE, protocol, policy).time_s
            assert t <= predict(four_shards, STUDY_NOISE, protocol, policy).time_s <= busy
    # 8 workers x 2 x 40 MB per step against one shard's 1.25 GB/s: 15.6 steps of 64 samples a second in all
    assert predict(one_shard, STUDY_NOISE, "asgd", "fixed").samples_per_s == pytest.approx(1.25e9 / 8e7 * 64)


@pytest.mark.parametrize(
    "name, cluster",
    [*_files().items(), *((n, _builtin(n)) for n in PROFILES), *((f"random{s}", random_cluster(s)) for s in range(40))],
)
def test_no_method_is_predicted_below_the_optimum(name: str, cluster: Cluster) -> None:
    star = optimum(cluster, STUDY_NOISE).time_s
    for p in predict_all(cluster, STUDY_NOISE):
        assert p.time_s >= star * (1 - 1e-9), (name, p.protocol, p.policy, p.time_s, star)


@pytest.mark.parametrize("name, cluster", [*_files().items(), *((n, _builtin(n)) for n in PROFILES)])
def test_auto_chooses_the_fastest_predicted_method_and_says_why(name: str, cluster: Cluster) -> None:
    choice = choose(cluster, STUDY_NOISE)
    ranked = [p for p in predict_all(cluster, STUDY_NOISE) if choosable(p)]
    assert (choice.protocol, choice.policy) == (ranked[0].protocol, ranked[0].policy)
    assert choice.reason.startswith(f"{choice.protocol} + {choice.policy}: predicted fastest") and "T*" in choice.reason


def test_auto_keeps_the_running_method_unless_another_is_clearly_faster() -> None:
    cluster = Cluster((Node(GPU),) * 2 + (Node(Device(0.03, 0.0008)),) * 2, 256)
    among = ("asgd", "ssgd")
    ranked = predict_all(cluster, STUDY_NOISE, among)
    close = next(p for p in ranked[1:] if p.time_s <= ranked[0].time_s * (1 + HYSTERESIS))
    kept = choose(cluster, STUDY_NOISE, current=(close.protocol, close.policy), protocols=among)
    assert (kept.protocol, kept.policy) == (close.protocol, close.policy)
    assert kept.reason.startswith(f"{close.protocol} + {close.policy}: kept, predicted"), kept.reason
    assert choice_of(kept.reason) == choice_of(
        choose(cluster, STUDY_NOISE, protocols=[close.protocol], policies=[close.policy]).reason
    ), "a kept choice is named as when it was made, so the console shows no line for it"
    far = ranked[-1]
    assert far.time_s > ranked[0].time_s * (1 + HYSTERESIS)
    moved = choose(cluster, STUDY_NOISE, current=(far.protocol, far.policy), protocols=among)
    assert (moved.protocol, moved.policy) == (ranked[0].protocol, ranked[0].policy)
    # a running job's protocol is fixed: only its policy may follow
    only = choose(cluster, STUDY_NOISE, protocols=("ssgd",))
    assert only.protocol == "ssgd"
    with pytest.raises(ValueError, match="none of"):
        choose(cluster, STUDY_NOISE, protocols=("msd",))


def test_a_cluster_without_workers_or_batch_and_an_unmodelled_method_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Cluster((), 64)
    with pytest.raises(ValueError, match="global batch"):
        Cluster((Node(GPU),), 0)
    with pytest.raises(KeyError):
        predict(Cluster((Node(GPU),), 64), STUDY_NOISE, "msd", "fixed")


def test_a_rounds_pushes_queue_at_the_shard_when_its_workers_finish_together() -> None:
    """n equal workers sized for equal steps finish together: the round closes once the shard has served all n
    pushes, one after another; workers that finish apart (fixed batches on unequal devices) queue less."""
    slow_gpu = Device(0.1, 0.002)
    equal = Cluster((Node(slow_gpu, 10000),) * 8, 512, 4e7, 40, 4, 10000)
    service = 4e7 / 4 * 8 / 1e10
    lb_bsp = predict(equal, STUDY_NOISE, "ssgd", "dynamic")
    assert 512 / lb_bsp.samples_per_s == pytest.approx(max(lb_bsp.step_s) + 8 * service)
    unequal = replace(equal, nodes=(Node(slow_gpu, 10000),) * 4 + (Node(Device(0.1, 0.006), 10000),) * 4)
    fixed = predict(unequal, STUDY_NOISE, "ssgd", "fixed")
    assert 512 / fixed.samples_per_s == pytest.approx(max(fixed.step_s) + 4 * service), "only the slow four queue"
    assert predict(replace(equal, shard_mbit=0), STUDY_NOISE, "ssgd", "dynamic").samples_per_s == pytest.approx(
        512 / max(lb_bsp.step_s)
    ), "shards that serve at once add nothing"
