"""The cluster `--protocol auto` chooses on, as the scheduler measures it (scheduler/measured_cluster.py): each
worker's compute and its link's own transfers apart from the time they spent at a busy shard, which the shards'
reports (ps/serving_load.py) give as the shards' service time. Pure functions on the shipped cluster files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.auto_evidence import predictor_cluster
from dynabatch.common.planning.auto_choice import choose
from dynabatch.common.planning.cluster_file import read_cluster
from dynabatch.common.planning.optimum import STUDY_NOISE
from dynabatch.common.planning.prediction import Cluster
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import Init, Pull, Push, ShardHeartbeat
from dynabatch.ps.serving_load import ServingLoad
from dynabatch.scheduler.measured_cluster import MeasuredWorker, ShardLoad, TransferTally, measured_cluster
from dynabatch.scheduler.report_bounds import check_shard_heartbeat
from dynabatch.scheduler.speed_model import SpeedModel, StepModel

PROFILES = Path(__file__).resolve().parent.parent / "bench" / "profiles"
FILES = ("cpu_gpu8", "mixed_gpus16", "mixed_links16", "ps_bound64")
QUEUE = 3.0
"""How many services a transfer of the measured job waited at the shard before its own: a busy shard."""
CHUNK_BYTES = 1 << 20


def _as_measured(described: Cluster, round_steps: int = 1) -> tuple[dict[str, MeasuredWorker], ShardLoad]:
    """What the scheduler hears from a job on `described` whose every transfer waited QUEUE services at the shard:
    each worker's compute curve and the seconds of a reported step it spent not computing (its link's transfers
    and twice the time at the shard, spread over `round_steps` under local SGD), the shard's reported seconds."""
    service = described.push_service_s()
    held = (1 + QUEUE) * service
    workers = {
        f"w{i:02d}": MeasuredWorker(
            StepModel(n.device.fixed_s, n.device.per_sample_s),
            (described.transfer_s(n) + 2 * held) / round_steps,
            n.device.max_batch,
        )
        for i, n in enumerate(described.nodes)
    }
    transfers = 1000.0
    return workers, ShardLoad(service * transfers, QUEUE * service * transfers, transfers)


def _cluster(described: Cluster, workers: dict[str, MeasuredWorker], load: ShardLoad | None, h: int = 1) -> Cluster:
    return measured_cluster(
        workers, load, described.model_bytes, described.global_batch, h, described.local_steps, CHUNK_BYTES
    )


@pytest.mark.parametrize("name", FILES)
def test_the_measured_cluster_gets_the_files_pick_with_the_shards_queue_taken_off_the_links(name: str) -> None:
    described = predictor_cluster(read_cluster(PROFILES / f"{name}.json"))
    workers, load = _as_measured(described)
    measured = _cluster(described, workers, load)
    for node, own in zip(measured.nodes, described.nodes, strict=True):
        assert measured.transfer_s(node) == pytest.approx(described.transfer_s(own), rel=1e-6)
    assert measured.push_service_s() == pytest.approx(described.push_service_s())
    picked, expected = choose(measured, STUDY_NOISE), choose(described, STUDY_NOISE)
    assert (picked.protocol, picked.policy) == (expected.protocol, expected.policy), picked.reason


def test_without_the_shards_figures_their_queue_is_counted_as_every_workers_link() -> None:
    """cpu_gpu8, where one shard bounds the job: with no shard report, the time its transfers waited at the shard
    stays in each worker's link and the shards serve at once, so no protocol is seen to relieve them."""
    described = predictor_cluster(read_cluster(PROFILES / "cpu_gpu8.json"))
    workers, _ = _as_measured(described)
    blind = _cluster(described, workers, None)
    held = 2 * (1 + QUEUE) * described.push_service_s()
    assert blind.shard_mbit == 0 and blind.max_steps_per_s() == float("inf")
    for node, own in zip(blind.nodes, described.nodes, strict=True):
        assert blind.transfer_s(node) == pytest.approx(described.transfer_s(own) + held, rel=1e-6)


def test_under_local_sgd_a_reported_step_carries_a_round_of_transfers_over_h() -> None:
    described = predictor_cluster(read_cluster(PROFILES / "ps_bound64.json"))
    h = described.local_steps
    gradient, load = _as_measured(described)
    local, _ = _as_measured(described, round_steps=h)
    assert _cluster(described, local, load, h) == _cluster(described, gradient, load)


def test_the_tally_takes_the_model_bytes_from_the_workers_and_the_slowest_shards_own_count() -> None:
    tally = TransferTally()
    assert tally.load() is None, "nothing served yet"
    tally.stepped("w0", 10, 10 * 2 * 1000, round_steps=1)
    assert tally.model_bytes == pytest.approx(1000)
    tally.stepped("w1", 8, 8 * 2 * 3000 // 4, round_steps=4)  # local SGD: a round of 4 steps moves the model twice
    assert tally.model_bytes == pytest.approx(3000)
    tally.stepped("w1", 8, 8 * 2 * 3000 // 4, round_steps=4)
    assert tally.model_bytes == pytest.approx(3000), "a report of no new step changes nothing"
    tally.shard_reported(0, 0.0, 0.0, 0.0)
    assert tally.load() is None, "a shard that served nothing in no time tells nothing"
    tally.shard_reported(0, 2.4, 1.2, 24.0)
    tally.shard_reported(1, 4.8, 0.6, 12.0)
    load = tally.load()
    assert load == ShardLoad(4.8, 0.6, 12.0), "the shard slower per transfer, on its own count"
    assert load.service_s() == pytest.approx(0.4) and load.held_s() == pytest.approx(0.45)


def test_the_shard_counts_only_pulls_and_pushes_as_serving() -> None:
    load = ServingLoad()
    load.served(Pull.TYPE, received=1.0, started=1.5, ended=1.75)
    load.served(Push.TYPE, received=2.0, started=2.0, ended=2.5)
    load.served(Init.TYPE, received=3.0, started=4.0, ended=9.0)
    assert load.busy_s == pytest.approx(0.75) and load.queued_s == pytest.approx(0.5)
    assert load.served_count == 2 and load.busy_sq_s == pytest.approx(0.25**2 + 0.5**2), "the spread's inputs"
    load.moved(300, 400)
    load.moved(100, 400)
    load.moved(7, 0)
    assert load.transfers == pytest.approx(1.0), "a chunk of 300 and one of 100 of the shard's 400: one transfer"
    load.pushed_by(["w1", ""])
    load.pushed_by(["w1"])
    assert load.pushers == {"w1"}, "who pushed, each once; no one's push names no one"


def test_a_workers_compute_curve_takes_its_probes_fixed_cost_and_its_overhead_apart() -> None:
    speed = SpeedModel(prior_samples_per_s=1000.0, prior_fixed_s=0.02)
    assert speed.compute_curve() is None and speed.overhead_s() is None, "no compute time reported yet"
    for _ in range(4):
        speed.observe(64, 0.02 + 64 * 0.001 + 0.3, 0.02 + 64 * 0.001)
    curve = speed.compute_curve()
    assert curve is not None
    assert curve.fixed_s == pytest.approx(0.02) and curve.per_sample_s == pytest.approx(0.001)
    assert speed.overhead_s() == pytest.approx(0.3)
    assert replace(curve, fixed_s=0.0).step_seconds(64) < curve.step_seconds(64)


def test_transfers_count_where_no_worker_reported_the_bytes_it_moved() -> None:
    workers = {"w0": MeasuredWorker(StepModel(0.0, 0.001), 0.05), "w1": MeasuredWorker(StepModel(0.0, 0.001), 0.2)}
    cluster = measured_cluster(workers, ShardLoad(1.0, 0.0, 100.0), 0.0, 64, 1, 8, CHUNK_BYTES)
    assert [cluster.transfer_s(n) for n in cluster.nodes] == [pytest.approx(0.05 - 0.02), pytest.approx(0.2 - 0.02)]
    assert cluster.push_service_s() == pytest.approx(0.01) and cluster.chunks == 1


def test_a_shard_heartbeats_service_squares_are_what_its_services_can_square_to() -> None:
    load = ServingLoad()
    load.served(Pull.TYPE, received=1.0, started=1.0, ended=1.25)
    load.served(Push.TYPE, received=2.0, started=2.0, ended=2.5)
    told = ShardHeartbeat(busy_s=load.busy_s, busy_sq_s=load.busy_sq_s, served=load.served_count, transfers=4.0)
    check_shard_heartbeat(told, max_rollbacks=0, max_batch=96)
    for wrong in (
        replace(told, busy_sq_s=0.2),  # below 0.75^2 / 2: two services cannot be more alike than equal
        replace(told, busy_sq_s=0.6),  # above 0.75^2: more than one service taking all of it
        replace(told, served=0),  # squares of nothing served
        replace(told, served=-1),
        replace(told, transfers=-1.0),
        replace(told, transfers=float("nan")),
        replace(told, transfers=4.5),  # two messages move at most four parts: each a push and the pull it carries
    ):
        with pytest.raises(ProtocolError) as refused:
            check_shard_heartbeat(wrong, max_rollbacks=0, max_batch=96)
        assert refused.value.code == ErrorCode.BAD_FIELD, wrong
