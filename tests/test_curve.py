"""ZeroMQ CURVE: `dynabatch keys`, a job that trains encrypted, and peers without the key refused and counted."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from dynabatch.common.net.curve import (
    KEY_FILES,
    KEYS_BY_ROLE,
    CurveKeyError,
    CurveKeys,
    create_keys,
    key_name,
    key_role,
)
from dynabatch.common.net.transport import Connection, RemoteError, use_curve
from dynabatch.common.wire.messages import EvalReport, Hello, Pull, Push, Role
from hang_guard import hang_guard_s
from harness import Cluster, Proc, free_port, metric_value, run_job, wait_for


def _keys(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
    )


def test_keys_writes_a_server_and_one_client_keypair_per_role_and_never_overwrites_silently(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    made = _keys(out)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(KEY_FILES)
    for name in KEY_FILES:
        assert stat.S_IMODE((out / name).stat().st_mode) == (0o600 if name.endswith("_secret") else 0o644), name
    assert "--curve-dir" in made.stdout and "create secret generic dynabatch-curve" in made.stdout
    server, ps = CurveKeys.load(str(out), "scheduler"), CurveKeys.load(str(out), "ps")
    clients = {role: CurveKeys.load(str(out), role) for role in ("worker", "evaluator")}
    assert server.server_secret and server.client_secret is None and not clients["worker"].admitted
    assert len({ps.client_public, *(c.client_public for c in clients.values()), server.server_public}) == 4
    assert server.admitted == {
        ps.client_public: "shard",
        clients["worker"].client_public: "worker",
        clients["evaluator"].client_public: "evaluator",
    }
    assert ps.admitted == {k: v for k, v in server.admitted.items() if v != "shard"}, "a shard serves no shard"

    before = {name: (out / name).read_bytes() for name in KEY_FILES}
    again = _keys(out)
    assert again.returncode == 2 and "already exist" in again.stderr and "--force" in again.stderr
    assert {name: (out / name).read_bytes() for name in KEY_FILES} == before

    forced = _keys(out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert all((out / name).read_bytes() != before[name] for name in KEY_FILES)


def test_a_key_per_machine_is_admitted_under_its_role_and_names_must_be_role_eq_name(tmp_path: Path) -> None:
    assert _keys(tmp_path, "--name", "worker=gpu-a", "--name", "evaluator=e1").returncode == 0
    server = CurveKeys.load(str(tmp_path), "scheduler")
    names = sorted(server.admitted.values())
    assert names == ["evaluator", "evaluator-e1", "shard", "worker", "worker-gpu-a"]
    assert {key_role(n) for n in names} == {"shard", "worker", "evaluator"}
    assert "worker-gpu-a" in CurveKeys.load(str(tmp_path), "ps").admitted.values()
    for bad in ("scheduler=x", "worker", "worker=", "worker=a/b"):
        with pytest.raises(ValueError, match="ROLE=NAME"):
            key_name(bad)
    assert key_name("worker=gpu-a") == "worker-gpu-a"


def test_every_missing_key_file_of_a_role_is_named(tmp_path: Path) -> None:
    create_keys(tmp_path / "all", force=False)
    for role, files in KEYS_BY_ROLE.items():
        for missing in files:
            folder = tmp_path / f"{role}-{missing}"
            folder.mkdir()
            for name in files:
                if name != missing:
                    (folder / name).write_bytes((tmp_path / "all" / name).read_bytes())
            with pytest.raises(CurveKeyError, match=re.escape(str(folder / missing))):
                CurveKeys.load(str(folder), role)


@pytest.mark.parametrize(
    "role, missing",
    [
        ("scheduler", "shard.key"),
        ("ps", "shard.key_secret"),
        ("worker", "server.key"),
        ("evaluator", "evaluator.key_secret"),
    ],
)
def test_a_missing_key_file_exits_2_naming_it(tmp_path: Path, role: str, missing: str) -> None:
    create_keys(tmp_path, force=False)
    (tmp_path / missing).unlink()
    command = ["worker", "--evaluator"] if role == "evaluator" else [role]
    out = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", *command, "--curve-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
    )
    assert out.returncode == 2
    assert str(tmp_path / missing) in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("role", sorted(KEYS_BY_ROLE))
def test_each_role_loads_from_only_its_own_key_files(tmp_path: Path, role: str) -> None:
    """What the manifests mount per pod is enough, and no secret a role does not use is read."""
    create_keys(tmp_path / "all", force=False)
    (tmp_path / "mine").mkdir()
    for name in KEYS_BY_ROLE[role]:
        (tmp_path / "mine" / name).write_bytes((tmp_path / "all" / name).read_bytes())
    keys = CurveKeys.load(str(tmp_path / "mine"), role)
    assert (keys.server_secret is not None) == ("server.key_secret" in KEYS_BY_ROLE[role])
    assert (keys.client_secret is not None) == any(
        n.endswith(".key_secret") and n != "server.key_secret" for n in KEYS_BY_ROLE[role]
    )
    for client in ("worker", "evaluator"):
        assert "server.key_secret" not in KEYS_BY_ROLE[client], "a worker node must not be able to pose as a server"
        assert [n for n in KEYS_BY_ROLE[client] if n.endswith("_secret")] == [f"{client}.key_secret"], (
            "nor as another role"
        )


def _refused(text: str, role: str) -> dict[str, float]:
    return {
        reason: metric_value(text, "dynabatch_auth_failures_total", role=role, reason=reason)
        for reason in ("auth", "protocol", "other")
    }


def _wait_refused(proc: Proc, role: str, reasons: tuple[str, ...]) -> None:
    counts: dict[str, float] = {}

    def counted() -> bool:
        counts.update(_refused(proc.metrics(), role))
        return sum(counts[r] for r in reasons) >= 1

    try:
        wait_for(f"{role} to count a refused handshake as {' or '.join(reasons)}", counted, 10)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its counts: {counts}") from None


@pytest.mark.slow
def test_job_trains_with_curve_and_refuses_peers_without_the_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert _keys(keys).returncode == 0
    c = Cluster(
        tmp_path,
        ["--dataset", "synthetic", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "1"],
        curve_dir=str(keys),
    )
    try:
        scheduler = c.scheduler()
        shard_port = free_port()
        shard = c.shard(0, shard_port)
        c.worker("a")
        c.worker("ev", "--evaluator")
        before = c.wait_status(
            "encrypted training and an evaluation",
            lambda s: s.workers and all(w.steps > 3 for w in s.workers.values()) and s.test_acc is not None,
        )
        assert _refused(scheduler.metrics(), "scheduler") == {"auth": 0, "protocol": 0, "other": 0}
        bad_before = metric_value(scheduler.metrics(), "dynabatch_bad_messages_total")

        # A fresh client keypair that knows the (public) server key: CURVE works, ZAP says no.
        intruder = CurveKeys.load(str(keys), "worker")
        assert _keys(tmp_path / "other").returncode == 0
        other = CurveKeys.load(str(tmp_path / "other"), "worker")
        wrong_ctx, plain_ctx = zmq.Context(), zmq.Context()
        use_curve(wrong_ctx, CurveKeys(intruder.server_public, other.client_public, other.client_secret, None))
        targets = [
            (scheduler, "scheduler", c.scheduler_endpoint, Hello(role=Role.WORKER, name="intruder")),
            (shard, "ps", f"tcp://127.0.0.1:{shard_port}", Pull(ids=[0])),
        ]
        try:
            for proc, role, endpoint, body in targets:
                # Each refusal is counted by the server's socket monitor, a thread of its own: wait for it.
                # A client without CURVE fails as `protocol`, or as `other` when it hung up first (libzmq's race).
                for ctx, reasons in ((plain_ctx, ("protocol", "other")), (wrong_ctx, ("auth",))):
                    conn = Connection(ctx, endpoint, "dynabatch", "intruder")
                    try:
                        with pytest.raises(TimeoutError):
                            conn.request(body, timeout_s=2.0)
                    finally:
                        conn.close()
                    _wait_refused(proc, role, reasons)
        finally:
            wrong_ctx.destroy(linger=0)
            plain_ctx.destroy(linger=0)

        after = c.wait_status("training to go on", lambda s: s.samples > before.samples + 1000)
        assert after.workers.keys() == before.workers.keys(), "no intruder joined"
        assert all(w.name != "intruder" for w in after.workers.values())
        assert metric_value(scheduler.metrics(), "dynabatch_bad_messages_total") == bad_before, (
            "refused peers never reach the message handler"
        )
        _each_key_sends_only_what_its_role_may(c, keys, scheduler, shard, f"tcp://127.0.0.1:{shard_port}")
        assert all(p.alive() for p in c.procs)
    finally:
        c.stop()


def _each_key_sends_only_what_its_role_may(
    c: Cluster, keys: Path, scheduler: Proc, shard: Proc, shard_endpoint: str
) -> None:
    """A worker key cannot register a shard or report an evaluation, an evaluator key cannot push, and a shard
    key is not even admitted by a shard: refused as `bad_role` (counted) or in the handshake."""
    contexts = {}
    for role in ("worker", "evaluator", "ps"):
        contexts[role] = zmq.Context()
        use_curve(contexts[role], CurveKeys.load(str(keys), role))
    cases = [
        ("worker", c.scheduler_endpoint, Hello(role=Role.SHARD, endpoint="tcp://127.0.0.1:1", shard_index=0)),
        ("worker", c.scheduler_endpoint, Hello(role=Role.EVALUATOR, name="fake-evaluator")),
        ("evaluator", c.scheduler_endpoint, Hello(role=Role.WORKER, name="fake-worker")),
        ("ps", c.scheduler_endpoint, Hello(role=Role.WORKER, name="fake-worker")),
        ("worker", c.scheduler_endpoint, EvalReport(version=1, test_loss=0.1, test_acc=0.99)),
        ("evaluator", shard_endpoint, Push(samples=1)),
    ]
    try:
        for role, endpoint, body in cases:
            conn = Connection(contexts[role], endpoint, "dynabatch", "w0")
            try:
                with pytest.raises(RemoteError) as refused:
                    conn.request(body, timeout_s=10)
                assert refused.value.code == "bad_role", (role, body, refused.value)
            finally:
                conn.close()
        assert metric_value(scheduler.metrics(), "dynabatch_bad_messages_total", reason="bad_role") == 5
        assert metric_value(shard.metrics(), "dynabatch_bad_messages_total", reason="bad_role") == 1
        conn = Connection(contexts["ps"], shard_endpoint, "dynabatch", "w0")
        try:
            with pytest.raises(TimeoutError):
                conn.request(Pull(ids=[0]), timeout_s=2.0)
        finally:
            conn.close()
        _wait_refused(shard, "ps", ("auth",))
        # and what each role may send still passes: an evaluator key pulls
        conn = Connection(contexts["evaluator"], shard_endpoint, "dynabatch", "eval-probe")
        try:
            assert conn.request(Pull(ids=[0]), timeout_s=10).chunks
        finally:
            conn.close()
    finally:
        for ctx in contexts.values():
            ctx.destroy(linger=0)


@pytest.mark.slow
def test_dynabatch_run_with_curve_dir_finishes(tmp_path: Path) -> None:
    """`dynabatch run --curve-dir`: every child and the run's own STATUS link use the keys."""
    keys = tmp_path / "keys"
    assert _keys(keys).returncode == 0
    run, _ = run_job(
        tmp_path,
        "r",
        "--curve-dir",
        str(keys),
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--epochs",
        "0.5",
        "--workers",
        "1",
        "--slowdowns",
        "1",
        "--eval-interval-s",
        "1",
        timeout_s=240,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], (
        "the evaluator's final report (sent just before it left) arrived"
    )
