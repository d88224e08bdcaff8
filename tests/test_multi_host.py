"""A job across separate hosts: network namespaces with addresses of their own, shaped links, no loopback shared.

Each host is a network namespace (tests/netns.py) on one bridge, its link shaped with
tbf; every process is started with the README's "A job across machines" commands
(tests/hosted_job.py): bound on 0.0.0.0, shards advertising their host's name, CURVE on
with each role's own keys, /metrics on 0.0.0.0 for a real Prometheus on a host of its own.

Where network namespaces cannot be made (not root, no CAP_NET_ADMIN, no iproute2) these
tests say why and skip, and fail under CI (tests/tools.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynabatch.common.config import JobConfig
from harness import wait_for
from tests import netns
from tests.hosted_job import METRICS_PORT, HostedJob
from tools import missing, need_tool

pytestmark = pytest.mark.slow

DATA = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
# The README's job, kept short: Fashion-MNIST's MLP, run until the test has seen what it needs.
JOB = ["--dataset", "fashion-mnist", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "2"]
SLOW_LINK = "100mbit"
PROMETHEUS_PORT = 9090


@pytest.fixture
def net() -> Iterator[netns.Network]:
    """A fresh network of hosts, removed at the end however the test ended; stale ones of dead runs swept first."""
    reason = netns.unavailable()
    if reason is not None:
        warnings.warn(f"MULTI-HOST TESTS NOT RUN: {reason}", stacklevel=1)
        missing(f"the multi-host tests need network namespaces: {reason}")
    if not Path(DATA).exists():
        missing(f"Fashion-MNIST is not installed ({DATA}; apt-get install dataset-fashion-mnist)")
    netns.sweep_stale()
    network = netns.Network()
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def keys(tmp_path: Path) -> str:
    """The job's CURVE keys, as `dynabatch keys` makes them (HostedJob hands each role only its own files)."""
    folder = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(folder)], check=True, capture_output=True
    )
    return str(folder)


@pytest.fixture
def job(net: netns.Network, tmp_path: Path, keys: str) -> Iterator[HostedJob]:
    hosted = HostedJob(net, tmp_path / "logs", keys)
    try:
        yield hosted
    finally:
        hosted.stop()


def _failure_report(job: HostedJob) -> str:
    return "".join(
        f"\n--- {c.name} exited with {c.proc.returncode}; its log ends:\n{c.log_tail(25)}"
        for c in job.launcher.failed()
    )


def _wait(job: HostedJob, what: str, predicate: Any, timeout_s: float = 120) -> Any:
    """`wait_for` that names every process that exited with an error when it times out."""
    try:
        return wait_for(what, predicate, timeout_s, every_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{_failure_report(job)}") from None


def _value_or_zero(job: HostedJob, host: netns.Host, name: str, **labels: str) -> float:
    """A process's series, 0 while it does not serve /metrics yet (starting, or its link is down)."""
    try:
        return job.value(host, name, 0, **labels)
    except OSError:
        return 0.0


# ---------------------------------------------------------------- Prometheus on a host of its own


def _start_prometheus(job: HostedJob, host: netns.Host, targets: list[netns.Host], tmp_path: Path) -> None:
    prometheus = need_tool("prometheus", "apt-get install -y prometheus")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
                "scrape_configs": [
                    {
                        "job_name": "dynabatch",
                        "scrape_timeout": "2s",
                        "static_configs": [{"targets": [f"{t.name}:{METRICS_PORT}" for t in targets]}],
                    }
                ],
            }
        )
    )
    job.launcher.spawn(
        "prometheus",
        "prometheus",
        host.command(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
            ]
        ),
    )


def _prometheus(host: netns.Host, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{PROMETHEUS_PORT}{path}?{urllib.parse.urlencode(params)}"
    body = json.loads(host.get(url))
    assert body["status"] == "success", body
    return body["data"]


def _scraped_up(host: netns.Host, expected: set[str]) -> bool:
    try:
        active = _prometheus(host, "/api/v1/targets")["activeTargets"]
    except OSError:
        return False
    return {t["labels"]["instance"] for t in active if t["health"] == "up"} == expected


TRAINED = "dynabatch_worker_steps_total > 0"


def _instances_with(host: netns.Host, query: str) -> set[str]:
    """The instances of the series Prometheus on `host` returns for `query` (empty while it cannot answer)."""
    try:
        return {s["metric"]["instance"] for s in _prometheus(host, "/api/v1/query", query=query)["result"]}
    except OSError:
        return set()


# ---------------------------------------------------------------- tests


def test_a_job_across_five_hosts_as_the_readme_starts_it(net: netns.Network, job: HostedJob, tmp_path: Path) -> None:
    """Scheduler on host-a, a shard on host-b, workers on host-c (behind 100 Mbit) and host-d, the evaluator on
    host-e, Prometheus on a sixth host scraping all five; then a worker on a new host joins the running job."""
    a, b = net.add_host("host-a"), net.add_host("host-b")
    c, d = net.add_host("host-c", SLOW_LINK), net.add_host("host-d")
    e, monitor = net.add_host("host-e"), net.add_host("monitor")
    job.scheduler(a, *JOB)
    shard = job.shard(b)
    workers = {"host-c": job.worker(c), "host-d": job.worker(d)}
    job.worker(e, evaluator=True)
    _start_prometheus(job, monitor, [a, b, c, d, e], tmp_path)

    # The job trains: both workers take steps, and the evaluator's accuracy of the shared model rises.
    _wait(
        job,
        "both workers to train across the bridge",
        lambda: all(_value_or_zero(job, h, "dynabatch_worker_steps_total") > 0 for h in (c, d)),
    )
    _wait(
        job,
        "the evaluator to report an accuracy above chance",
        lambda: _value_or_zero(job, a, "dynabatch_job_test_accuracy") > 0.5,
    )
    # The shard listens on every interface and workers reach it by the name it advertised.
    shard_log = shard.log_text()
    assert "tcp://0.0.0.0:5600" in shard_log and "tcp://host-b:5600" in shard_log, shard_log

    # Prometheus on its own host scrapes every process, each through its host's address.
    expected = {f"{h.name}:{METRICS_PORT}" for h in (a, b, c, d, e)}
    _wait(job, "Prometheus to scrape all five processes", lambda: _scraped_up(monitor, expected))
    # A target is up from its first scrape, which may predate its worker's first step: wait for a scrape after it.
    training = {f"{h.name}:{METRICS_PORT}" for h in (c, d)}
    _wait(job, "Prometheus to see both workers' steps", lambda: _instances_with(monitor, TRAINED) == training)

    # A worker on a host that did not exist when the job started joins it and gets a share.
    f = net.add_host("host-f")
    job.worker(f)
    _wait(job, "the new host's worker to train", lambda: _value_or_zero(job, f, "dynabatch_worker_samples_total") > 0)
    _wait(job, "three live workers", lambda: _value_or_zero(job, a, "dynabatch_scheduler_live_workers") == 3)
    assert not job.launcher.failed(), _failure_report(job)
    assert all(w.alive() for w in workers.values())


OUTAGE_S = 10.0
STEPS = 20  # worker steps that show training going on (a few seconds of this job's MLP)


def test_a_shard_host_losing_its_link_for_ten_seconds_and_the_job_carrying_on(
    net: netns.Network, job: HostedJob
) -> None:
    a, b, c = net.add_host("host-a"), net.add_host("host-b"), net.add_host("host-c")
    job.scheduler(a, *JOB)
    job.shard(b)
    job.worker(c)

    def steps() -> float:
        return _value_or_zero(job, c, "dynabatch_worker_steps_total")

    _wait(job, f"the worker to take {STEPS} steps", lambda: steps() >= STEPS)
    net.set_link(b, up=False)
    cut = time.monotonic()
    # The outage itself: the shard's host is unreachable for OUTAGE_S; every process lives through it.
    with pytest.raises(OSError):
        c.get(f"http://host-b:{METRICS_PORT}/metrics", timeout_s=1.0)
    while time.monotonic() - cut < OUTAGE_S:
        assert not job.launcher.failed(), _failure_report(job)
        time.sleep(0.5)
    net.set_link(b, up=True)
    at_restore = steps()
    # After the link is back the job trains on, with the same processes: the worker steps again.
    _wait(job, f"{STEPS} more worker steps after the link came back", lambda: steps() >= at_restore + STEPS)
    _wait(job, "the job's samples to count the steps", lambda: _value_or_zero(job, a, "dynabatch_job_samples") > 0)
    assert not job.launcher.failed(), _failure_report(job)
    assert all(child.alive() for child in job.launcher.children), "no process was restarted or lost"


# The wire's schedule on a link that slows down and heals: a 2 MB model in 16 KiB chunks, sent in pushes of
# sqrt(overhead x rate x push bytes) (scheduler/chunk_schedule.py), the rate being what a step moved over the seconds
# it spent moving it. A 20 Mbit/s link caps that rate, so it is pushed chunk by chunk (two chunks need 21.5 Mbit/s).
# On a 1 Gbit/s link the rate is what the worker's CPU frames and sends: four chunks need 86 Mbit/s, which two copies
# of the suite on two cores did not leave it (120 s at fewer), two chunks 21.5 Mbit/s, 4 MB a step in 1.5 s.
WIRE_JOB = [
    "--dataset",
    "synthetic",
    "--model",
    "flat:500000",
    "--chunk-bytes",
    "16384",
    "--epochs",
    "1000",
    "--chunk-schedule",
    "scheduled",
    "--pipeline",
    "on",
    "--protocol",
    "asgd",  # chunks per push: a gradient protocol's, which auto could switch away from as the link slows
]
HEALTHY_GROUP = 2


def test_the_wire_schedule_follows_a_link_that_slows_down_and_recovers_when_it_heals(
    net: netns.Network, job: HostedJob
) -> None:
    a, b, w = net.add_host("host-a"), net.add_host("host-b"), net.add_host("host-w")
    job.scheduler(a, *WIRE_JOB)
    job.shard(b)
    job.worker(w)

    def group() -> float:
        return _value_or_zero(job, a, "dynabatch_worker_chunks_per_push")

    _wait(job, f"pushes of {HEALTHY_GROUP} chunks or more on a 1 Gbit link", lambda: group() >= HEALTHY_GROUP)
    net.set_rate(w, "20mbit")
    _wait(job, "pushes of one chunk on a 20 Mbit link", lambda: group() == 1)
    net.set_rate(w, "1gbit")
    _wait(job, f"pushes of {HEALTHY_GROUP} chunks or more once the link healed", lambda: group() >= HEALTHY_GROUP)
    assert not job.launcher.failed(), _failure_report(job)


# `--protocol auto` before any step, on links that bound the job: two workers whose every asgd step moves a 2 MB model
# in and out over 5 Mbit/s (6.4 s of link time a step, its compute a few milliseconds), where local SGD moves it once
# per 8 steps. Auto's first tier (scheduler/auto_inputs.py `_on_probes`) sees each worker's start-up probe, its first
# push timed from the batch the scheduler handed it and the shard's own service time, and chooses local SGD at its 3x
# margin before every worker has reported a step. At 20 Mbit/s a lone `.ci/run` once saw the second tier choose
# first, on the first steps: the slower link leaves the shard's report of the first pushes seconds ahead of the steps'
# end, and the compute, which a loaded machine stretches, a smaller part of either method's step. The job starts with
# both workers, so that the choice is made on both.
SLOW_LINKS_JOB = [
    *("--dataset", "synthetic", "--model", "flat:500000", "--epochs", "1000"),
    *("--protocol", "auto", "--min-workers", "2"),
]
FIRST_TIER = "chosen on every worker's start-up probe and first push"
LOCAL_ROUNDS = 2
DEFAULTS = JobConfig()


def test_auto_chooses_local_sgd_on_slow_links_before_the_workers_report_a_step(
    net: netns.Network, job: HostedJob
) -> None:
    a, b = net.add_host("host-a"), net.add_host("host-b")
    workers = [net.add_host(f"host-w{i}", rate="5mbit") for i in range(2)]
    scheduler = job.scheduler(a, *SLOW_LINKS_JOB)
    job.shard(b)
    children = [job.worker(w) for w in workers]

    def chose() -> list[str]:
        return [line for line in scheduler.log_since_start().splitlines() if "protocol auto chose" in line]

    def on_local() -> bool:
        return _value_or_zero(job, a, "dynabatch_scheduler_auto_protocol", protocol="local") == 1

    def samples() -> float:
        return _value_or_zero(job, a, "dynabatch_job_samples")

    _wait(job, "auto to switch the workers to local SGD", on_local)
    first = chose()
    assert len(first) == 1 and "chose local" in first[0] and FIRST_TIER in first[0], first
    assert "0 of 2 measured" in first[0], first
    # The workers then train in local rounds: each worker's H steps of its share of B.
    at_switch, round_samples = job.value(a, "dynabatch_job_samples"), DEFAULTS.local_steps * DEFAULTS.global_batch
    _wait(job, f"{LOCAL_ROUNDS} local rounds", lambda: samples() >= at_switch + LOCAL_ROUNDS * round_samples)
    assert chose() == first, "auto held its choice"
    # Each worker entered local SGD from the model its asgd step had pulled over its slow link, not pulling it again.
    for child in children:
        said = child.log_since_start()
        assert "protocol local from now on, was asgd" in said and "from the model it holds" in said, said
    assert not job.launcher.failed(), _failure_report(job)
