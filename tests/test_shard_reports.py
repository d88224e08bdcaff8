"""A real shard against a stand-in scheduler (scheduler_socket.py): it reports in its heartbeats the push bounds it
applied (ShardHeartbeat.batches), and at once when an answer grew one, not a heartbeat later. The scheduler hands a
worker a larger batch only once every shard reports it (ps/push_bounds.py), so a report that waited would hold the
worker's larger batch back for a heartbeat interval."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import zmq

from dynabatch.cluster.launcher import child_env, command_line
from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.wire.messages import ShardAssignment, ShardHeartbeat
from harness import free_port, kill_tree, wait_for
from scheduler_socket import SchedulerSocket

HEARTBEAT_S = 30.0  # the job's interval: a report that waited for the next heartbeat would come this late


def _heartbeats(router: SchedulerSocket) -> list[ShardHeartbeat]:
    return [body for _, body in list(router.got) if isinstance(body, ShardHeartbeat)]


def test_a_shard_reports_the_bounds_it_applied_and_at_once_when_one_grew(tmp_path: Path) -> None:
    router = SchedulerSocket(zmq.Context.instance())
    router.config = to_dict(
        JobConfig(job="j", dataset="synthetic", model="mlp", protocol="asgd", heartbeat_s=HEARTBEAT_S)
    )
    router.answer = ShardAssignment(live_workers=["w9"], batches={"w9": 32}, membership=1)
    log = (tmp_path / "ps.log").open("wb")
    shard = subprocess.Popen(
        command_line(
            "ps",
            [
                "--scheduler",
                router.endpoint,
                "--job",
                "j",
                "--shard-index",
                "0",
                "--bind",
                f"tcp://127.0.0.1:{free_port()}",
            ],
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    try:
        first = wait_for("the shard's first heartbeat", lambda: _heartbeats(router), 120)[0]
        answered = time.monotonic()
        assert first.batches is None, "it applied no answer yet"
        second = wait_for(
            "the shard's report of the bound it applied", lambda: _heartbeats(router)[1:], HEARTBEAT_S / 2
        )[0]
        assert time.monotonic() - answered < HEARTBEAT_S / 2
        assert second.batches == {"w9": 32} and second.membership == 1
    finally:
        kill_tree(shard.pid)
        shard.wait()
        log.close()
        router.close()
