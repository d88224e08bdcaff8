"""ZeroMQ CURVE: `dynabatch keys`, a job that trains encrypted, and peers without the key refused and counted."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from dynabatch.common.curve import KEY_FILES, CurveKeys
from dynabatch.common.messages import Hello, Pull
from dynabatch.common.transport import Connection, use_curve
from harness import Cluster, free_port, metric_value, wait_for


def _keys(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=60)


def test_keys_writes_two_keypairs_and_never_overwrites_silently(tmp_path):
    out = tmp_path / "keys"
    made = _keys(out)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(KEY_FILES)
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert "--curve-dir" in made.stdout and "create secret generic dynabatch-curve" in made.stdout
    server, client = CurveKeys.load(str(out), server=True), CurveKeys.load(str(out), server=False)
    assert server.server_secret and client.server_secret is None
    assert server.client_public == client.client_public != server.server_public

    before = {name: (out / name).read_bytes() for name in KEY_FILES}
    again = _keys(out)
    assert again.returncode == 2 and "already exist" in again.stderr and "--force" in again.stderr
    assert {name: (out / name).read_bytes() for name in KEY_FILES} == before

    forced = _keys(out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert all((out / name).read_bytes() != before[name] for name in KEY_FILES)


@pytest.mark.parametrize("role, missing", [("scheduler", "server.key_secret"), ("worker", "client.key_secret"),
                                           ("ps", "client.key")])
def test_a_missing_key_file_exits_2_naming_it(tmp_path, role, missing):
    assert _keys(tmp_path).returncode == 0
    (tmp_path / missing).unlink()
    out = subprocess.run([sys.executable, "-m", "dynabatch.cli.main", role, "--curve-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert str(tmp_path / missing) in out.stderr and "Traceback" not in out.stderr


def test_worker_needs_no_server_secret(tmp_path):
    """A machine that only runs workers gets server.key, client.key and client.key_secret."""
    assert _keys(tmp_path).returncode == 0
    (tmp_path / "server.key_secret").unlink()
    assert CurveKeys.load(str(tmp_path), server=False).client_secret


def _refused(text: str, role: str) -> dict[str, float]:
    return {reason: metric_value(text, "dynabatch_auth_failures_total", role=role, reason=reason)
            for reason in ("auth", "protocol")}


@pytest.mark.slow
def test_job_trains_with_curve_and_refuses_peers_without_the_key(tmp_path):
    keys = tmp_path / "keys"
    assert _keys(keys).returncode == 0
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "1"],
                curve_dir=str(keys))
    try:
        scheduler = c.scheduler()
        shard_port = free_port()
        shard = c.shard(0, shard_port)
        c.worker("a")
        c.worker("ev", "--evaluator")
        before = c.wait_status("encrypted training and an evaluation",
                               lambda s: s["workers"] and all(w["steps"] > 3 for w in s["workers"].values())
                               and s["test_acc"] is not None)
        assert _refused(scheduler.metrics(), "scheduler") == {"auth": 0, "protocol": 0}
        bad_before = metric_value(scheduler.metrics(), "dynabatch_bad_messages_total")

        # A fresh client keypair that knows the (public) server key: CURVE works, ZAP says no.
        intruder = CurveKeys.load(str(keys), server=False)
        assert _keys(tmp_path / "other").returncode == 0
        other = CurveKeys.load(str(tmp_path / "other"), server=False)
        wrong_ctx, plain_ctx = zmq.Context(), zmq.Context()
        use_curve(wrong_ctx, CurveKeys(intruder.server_public, other.client_public, other.client_secret, None))
        targets = [(scheduler, "scheduler", c.scheduler_endpoint, Hello(role="worker", name="intruder")),
                   (shard, "ps", f"tcp://127.0.0.1:{shard_port}", Pull(ids=[0]))]
        try:
            for proc, role, endpoint, body in targets:
                for ctx in (plain_ctx, wrong_ctx):
                    conn = Connection(ctx, endpoint, "dynabatch", "intruder")
                    try:
                        with pytest.raises(TimeoutError):
                            conn.request(body, timeout_s=2.0)
                    finally:
                        conn.close()
                # The server counts refusals from its socket monitor, a thread of its own: wait for it.
                refused = wait_for(f"{role} to count both refused handshakes",
                                   lambda: (lambda r: r if r["auth"] >= 1 and r["protocol"] >= 1 else None)(
                                       _refused(proc.metrics(), role)), 10)
                assert refused["auth"] >= 1 and refused["protocol"] >= 1
        finally:
            wrong_ctx.destroy(linger=0)
            plain_ctx.destroy(linger=0)

        after = c.wait_status("training to go on", lambda s: s["samples"] > before["samples"] + 1000)
        assert after["workers"].keys() == before["workers"].keys(), "no intruder joined"
        assert all(w["name"] != "intruder" for w in after["workers"].values())
        assert metric_value(scheduler.metrics(), "dynabatch_bad_messages_total") == bad_before, \
            "refused peers never reach the message handler"
        assert all(p.alive() for p in c.procs)
    finally:
        c.stop()



@pytest.mark.slow
def test_dynabatch_run_with_curve_dir_finishes(tmp_path):
    """`dynabatch run --curve-dir`: every child and the run's own STATUS link use the keys."""
    keys = tmp_path / "keys"
    assert _keys(keys).returncode == 0
    out = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "run", "--out", str(tmp_path), "--name", "r", "--curve-dir", str(keys),
         "--dataset", "synthetic", "--model", "mlp", "--epochs", "0.5", "--workers", "1", "--slowdowns", "1",
         "--eval-interval-s", "1"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"]
