"""A flood of connections that complete ZeroMQ's handshake, against a live scheduler and shard (issue 22).

Each server runs under a descriptor limit of LIMIT (set with `prlimit`, as an
operator would), which gives caps of a couple of hundred connections (CAPS). The
flood, from the address every member of the job connects from, is three times
that: without the caps it would take every descriptor the process has, and the
scheduler would die writing its progress file, the shard writing its checkpoint.
With them each server holds its cap, shuts the rest down and counts them, keeps
answering the members it had, keeps writing its files, and has every place back
once the flood hangs up. A job of several workers, all from one address, under
the default caps is never refused a connection.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynabatch.cluster.launcher import Child, command_line
from dynabatch.common.net.connection_caps import ConnectionCaps
from dynabatch.common.net.transport import Connection
from dynabatch.common.verified_files import load_newest_good
from dynabatch.common.wire.messages import StatusReply, StatusRequest
from dynabatch.scheduler.saved_progress import progress_path
from fuzz.greeting_flood import close_flood, descriptors, open_flood
from harness import Cluster, free_port, metric_value, wait_for
from tools import need_tool

pytestmark = pytest.mark.slow

LIMIT = 400
CAPS = ConnectionCaps.for_descriptor_limit(LIMIT)
FLOOD = 3 * CAPS.total
# Descriptors a server opens and closes of its own while it runs (a /metrics scrape, a file being written).
PASSING = 8
JOB = ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--liveness-timeout-s", "60"]


def _limited(c: Cluster, command: str, flags: list[str], endpoint: str) -> Child:
    """`dynabatch COMMAND FLAGS` under a descriptor limit of LIMIT, started as the launcher starts its children."""
    cmd = [
        need_tool("prlimit", "Debian: util-linux"),
        f"--nofile={LIMIT}:{LIMIT}",
        "--",
        *command_line(command, [*flags, "--metrics-host", "127.0.0.1", "--metrics-port", "0"]),
    ]
    child = c.launcher.spawn(command, command, cmd, serves_metrics=True, endpoint=endpoint)
    wait_for(f"the {command} to listen", lambda: child.listening() or not child.alive())
    assert child.alive(), child.log_tail()
    return child


def _samples(conn: Connection) -> int:
    reply = conn.request(StatusRequest(), timeout_s=30).body
    assert isinstance(reply, StatusReply), reply
    return reply.state.samples


def _saved_samples(progress: Path) -> int:
    """The samples in the scheduler's newest progress file, read as a restart reads it: while it replaces the
    file, only the previous copy is there for a moment."""
    saved: int | None = load_newest_good(progress, lambda _copy, payload: json.loads(payload)["samples"], print)
    assert saved is not None, f"no progress file at {progress}"
    return saved


def _count(child: Child, name: str, **labels: str) -> float:
    return metric_value(child.metrics(), name, **labels)


def test_a_flood_of_connections_is_held_to_the_caps_and_the_job_trains_and_writes_on(tmp_path: Path) -> None:
    c = Cluster(tmp_path, JOB)
    try:
        state = tmp_path / "state"
        scheduler = _limited(
            c,
            "scheduler",
            ["--bind", c.scheduler_endpoint, "--no-exit-on-finish", "--state-dir", str(state), *JOB],
            c.scheduler_endpoint,
        )
        shard_endpoint = f"tcp://127.0.0.1:{free_port()}"
        shard = _limited(
            c,
            "ps",
            [
                "--scheduler",
                c.scheduler_endpoint,
                "--bind",
                shard_endpoint,
                "--shard-index",
                "0",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                "--checkpoint-interval-s",
                "0.5",
            ],
            shard_endpoint,
        )
        c.worker("w0")
        member = c.client()  # connected before the flood, as every member of the job is
        wait_for("the worker to train", lambda: _samples(member) > 0)
        servers = {"scheduler": scheduler, "ps": shard}
        held = {role: _count(s, "dynabatch_connections", role=role) for role, s in servers.items()}
        before = {role: descriptors(s.proc.pid) for role, s in servers.items()}
        progress = progress_path(str(state), "dynabatch")
        samples, checkpoints = _samples(member), _count(shard, "dynabatch_ps_checkpoints_total", shard="0")
        floods = {
            role: open_flood("127.0.0.1", int(s.endpoint.rpartition(":")[2]), FLOOD) for role, s in servers.items()
        }
        try:
            for role, server in servers.items():

                def decided(role: str = role, server: Child = server) -> bool:
                    text = server.metrics()
                    refused = metric_value(text, "dynabatch_connections_refused_total", role=role)
                    return metric_value(text, "dynabatch_connections", role=role) + refused == held[role] + FLOOD

                wait_for(f"the {role} to admit or refuse every connection of the flood", decided)
                assert _count(server, "dynabatch_connections", role=role) == CAPS.total
                refused = _count(server, "dynabatch_connections_refused_total", role=role)
                assert refused == held[role] + FLOOD - CAPS.total

                def settled(pid: int = server.proc.pid, role: str = role) -> bool:
                    return descriptors(pid) <= before[role] + CAPS.total - held[role] + PASSING

                wait_for(f"the {role}'s descriptors to settle within its cap", settled)
            wait_for("the job to train on", lambda: _samples(member) > samples)
            saved = _saved_samples(progress)
            wait_for("the scheduler to write its progress", lambda: _saved_samples(progress) > saved)
            wait_for(
                "the shard to write a checkpoint",
                lambda: _count(shard, "dynabatch_ps_checkpoints_total", shard="0") > checkpoints,
            )
        finally:
            for flood in floods.values():
                close_flood(flood)
        for role, server in servers.items():

            def given_back(server: Child = server, role: str = role) -> bool:
                return _count(server, "dynabatch_connections", role=role) == held[role]

            def closed(pid: int = server.proc.pid, role: str = role) -> bool:
                return descriptors(pid) <= before[role] + PASSING

            wait_for(f"the {role} to give the flood's places back", given_back)
            wait_for(f"the {role}'s descriptors to come back", closed)
            assert server.alive() and "Too many open files" not in server.log_text()
        wait_for("the job to train after the flood", lambda: _samples(member) > samples)
        member.close()
    finally:
        c.stop()


def test_a_job_of_several_workers_from_one_address_is_never_refused_a_connection(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [*JOB, "--min-workers", "3"])
    try:
        scheduler, shard = c.scheduler(), c.shard(0)
        for name in ("w0", "w1", "w2"):
            c.worker(name)
        c.wait_status(
            "three workers to train", lambda st: len(st.workers) == 3 and all(w.steps > 0 for w in st.workers.values())
        )
        for role, server in (("scheduler", scheduler), ("ps", shard)):
            assert _count(server, "dynabatch_connections_refused_total", role=role) == 0
            assert _count(server, "dynabatch_connections", role=role) >= 3
    finally:
        c.stop()
