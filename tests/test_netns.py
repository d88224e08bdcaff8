"""The multi-host harness itself (tests/netns.py): hosts reach each other by name and nothing else, links are
shaped, and nothing is left behind, by a test that fails or by a run that was killed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hang_guard import hang_guard_s
from harness import wait_for
from tests import netns
from tools import missing

RECEIVER = (
    "import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); print('ready', flush=True); "
    "c, _ = s.accept(); n = 0\nwhile (d := c.recv(1 << 20)): n += len(d)\nprint(n)"
)
SENDER = "import socket, sys; s = socket.create_connection(('host-a', 7000)); s.sendall(b'x' * int(sys.argv[1]))"


@pytest.fixture(autouse=True)
def namespaces_possible() -> None:
    reason = netns.unavailable()
    if reason is not None:
        missing(f"network namespaces cannot be made here: {reason}")


def _namespaces() -> set[str]:
    return {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.strip()
    }


def _pids(ns: str) -> list[str]:
    """The processes running inside namespace `ns`."""
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()


def _send(net: netns.Network, sender: netns.Host, receiver: netns.Host, size: int) -> float:
    """Seconds `sender` takes to push `size` bytes to `receiver` (the receiver counts them all)."""
    rx = subprocess.Popen(receiver.command([sys.executable, "-c", RECEIVER]), stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    try:
        assert rx.stdout.readline().strip() == "ready"
        started = time.monotonic()
        subprocess.run(sender.command([sys.executable, "-c", SENDER, str(size)]), check=True, timeout=hang_guard_s(60))
        assert int(rx.stdout.readline()) == size
        return time.monotonic() - started
    finally:
        rx.kill()
        rx.wait()


def test_hosts_reach_each_other_by_name_over_shaped_links_and_nothing_else() -> None:
    with netns.Network() as net:
        a, b = net.add_host("host-a"), net.add_host("host-b", "100mbit")
        assert a.address == "198.18.0.1" and b.address == "198.18.0.2"
        named = subprocess.run(
            b.command([sys.executable, "-c", "import socket; print(socket.gethostname())"]),
            capture_output=True,
            text=True,
        )
        assert named.stdout.strip() == "host-b", named.stderr
        routes = subprocess.run(b.command(["ip", "route"]), capture_output=True, text=True).stdout.strip()
        assert routes.splitlines() == [f"198.18.0.0/15 dev eth0 proto kernel scope link src {b.address}"], routes
        outside = subprocess.run(b.command(["ip", "route", "get", "1.1.1.1"]), capture_output=True, text=True)
        assert outside.returncode != 0 and "unreachable" in outside.stderr, "no route out of a host"
        for ns, dev in ((b.ns, "eth0"), (net.bridge_ns, b.port)):
            qdisc = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, f"{ns} {dev}: {qdisc}"
        # 4 MB through a 100 Mbit link take at least 0.32 s (load only adds to that); unshaped, a few ms.
        size = 4_000_000
        assert _send(net, b, a, size) >= 0.9 * size * 8 / 100e6


def test_everything_is_removed_even_when_the_test_fails() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), netns.Network() as net:
        host = net.add_host("host-a")
        sleeper = subprocess.Popen(host.command(["sleep", "600"]))
        # Inside before the failure: on a loaded machine the teardown once removed the namespace before
        # `ip netns exec` had entered it (exit 255, nothing left running, but not the case this test is about).
        wait_for("the sleeper to enter the namespace or exit", lambda: _pids(host.ns) or sleeper.poll() is not None, 60)
        assert _pids(host.ns), "the sleeper runs inside the host's namespace"
        made = {net.bridge_ns, host.ns}
        assert made <= _namespaces() and (netns.NETNS_ETC / host.ns / "hosts").exists()
        raise RuntimeError("the test failed")
    assert sleeper.wait(10) == -9, "what still ran inside is stopped"
    assert not made & _namespaces()
    assert not (netns.NETNS_ETC / host.ns).exists()


def test_the_sweep_removes_only_the_namespaces_of_runs_that_died() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{netns.PREFIX}-{gone.pid}-abcdef-host-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.Network() as live:
            live.add_host("host-a")
            swept = netns.sweep_stale()
            assert stale in swept and stale not in _namespaces()
            assert live.bridge_ns in _namespaces() and not any(name.startswith(live.run) for name in swept)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_without_root_it_says_why() -> None:
    # The system's interpreter (this one may live under root's home); tests/netns.py needs nothing but the stdlib.
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        missing("no /usr/bin/python3 for an unprivileged probe")
    # The checkout may sit where only root can enter (a clone under /root, or in a `mktemp -d` folder), so the
    # probe's user gets its own copy of the module, in a folder of /tmp (which every user may enter), and imports
    # nothing else.
    readable = Path(tempfile.mkdtemp(prefix="netns-probe-", dir="/tmp"))
    try:
        readable.chmod(0o755)
        shutil.copy(Path(netns.__file__), readable / "netns.py")
        (readable / "netns.py").chmod(0o644)
        probe = "import sys; sys.path.insert(0, sys.argv[1]); import netns; print(netns.unavailable())"
        done = subprocess.run(
            [python, "-c", probe, str(readable)],
            capture_output=True,
            text=True,
            user=65534,
            cwd=readable,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp"},
            timeout=hang_guard_s(60),
        )
    finally:
        shutil.rmtree(readable)
    assert done.returncode == 0, done.stderr
    assert "root" in done.stdout, done.stdout
