"""Several "hosts" on one machine: network namespaces joined by shaped links, for tests and benchmarks.

Each host is a network namespace of its own with one interface, eth0, holding its own
address from 198.18.0.0/15 (the range set aside for network benchmarks, RFC 2544), and a
veth pair to a bridge that lives in a further namespace of the network's own. Every link
is shaped with tbf in both directions (`tc qdisc add dev X root tbf rate R burst 32kbit
latency 400ms`: on the host's eth0 for what it sends, on the bridge's port for what it
receives). No namespace has a route but the /15 on the bridge, and the machine's own
namespace has no leg on it: nothing inside reaches out, nothing outside reaches in. Hosts
know each other by name (host-a, ...) through /etc/netns/NS/hosts, which `ip netns exec`
mounts over /etc/hosts, and each process started on a host sees that name as its host name,
so commands read as they would on real machines.

Names carry the creating process's pid and a random token, so two suites at once never
collide; `Network.close` removes everything it made (a test's finalizer calls it however
the test ended), and `sweep_stale` removes what a killed run left behind: the namespaces
whose creating process is gone, after stopping what still ran inside them.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (`ip`, `tc`); `unavailable()`
says why a machine cannot, without changing anything. Self-contained (no test helpers),
so bench/ imports it as `tests.netns`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

SUBNET = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "dbn"  # every namespace this module makes: dbn-<creator pid>-<token>-<host>
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
CLONE_NEWNET = 0x40000000
BURST = "32kbit"  # above one 1500-byte frame, so tbf passes full-size packets
LATENCY = "400ms"  # how long a packet may wait in tbf's queue before it is dropped
T = TypeVar("T")


class NamespaceError(RuntimeError):
    """An `ip`/`tc` command failed: the command and what it printed."""


def _run(*argv: str) -> str:
    # A fixed guard, not tests/hang_guard.py's: this module imports the standard library alone (test_netns copies it
    # by itself for an unprivileged probe), and `ip` returns in milliseconds under any load.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespaceError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can): tried, then removed."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2: scripts/system-deps.sh --test)"
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this runs as uid {os.geteuid()}"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "show")
    except NamespaceError as exc:
        return f"cannot make a network namespace: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in namespace `ns` (by pid; only processes a run of this module started there)."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    for pid in (int(p) for p in listed.split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces of runs whose creating process has died (a killed test run); their names."""
    swept = []
    for entry in sorted(NETNS_RUN.iterdir()) if NETNS_RUN.is_dir() else []:
        m = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+-.+", entry.name)
        if m and not _pid_alive(int(m.group(1))):
            _delete(entry.name)
            swept.append(entry.name)
    return swept


def in_namespace(ns: str, fn: Callable[[], T]) -> T:
    """`fn()` run by a thread that has entered network namespace `ns`: its sockets are that host's.

    A network namespace is per thread (setns), so the caller's own thread stays where it is.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            fd = os.open(NETNS_RUN / ns, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@dataclass
class Host:
    """One namespace on the network: `address` on its eth0, `port` its interface on the bridge."""

    name: str
    ns: str
    address: str
    port: str
    rate: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host: in its network namespace, with its name as the host name (a UTS namespace of
        its own), so a process that names itself after its host (a shard's default name) tells hosts apart.
        Every step execs the next: the process started is `argv`'s, under the same pid."""
        rename = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", rename, self.name, *argv]

    def get(self, url: str, timeout_s: float = 5.0) -> bytes:
        """An HTTP GET made from this host (a URL with a host name resolves through the network's hosts file)."""
        hosts = Path(NETNS_ETC / self.ns / "hosts").read_text()
        for address, name in re.findall(r"^(\S+)\s+(\S+)$", hosts, re.M):
            url = re.sub(rf"(?<=//){re.escape(name)}(?=[:/])", address, url)

        def fetch() -> bytes:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                page: bytes = r.read()
            return page

        return in_namespace(self.ns, fetch)


@dataclass
class Network:
    """Hosts on one bridge; `close()` (or leaving a `with` block) removes every namespace it made."""

    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.run}-bridge"
        self._made: list[str] = []
        try:
            self._add_namespace(self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str, rate: str = "1gbit") -> Host:
        """A new host `name` (resolvable as such from every host) behind a link of `rate` each way."""
        if name in self.hosts:
            raise ValueError(f"host {name} exists")
        index = len(self.hosts)
        address = str(SUBNET[index + 1])
        host = Host(name, f"{self.run}-{name}", address, f"p{index}", rate)
        self._add_namespace(host.ns)
        _run(
            "ip",
            "link",
            "add",
            "eth0",
            "netns",
            host.ns,
            "type",
            "veth",
            "peer",
            "name",
            host.port,
            "netns",
            self.bridge_ns,
        )
        _run("ip", "-n", host.ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0", "up")
        self.hosts[name] = host
        self._shape(host, "add")
        self._write_hosts_files()
        return host

    def _shape(self, host: Host, verb: str) -> None:
        for ns, dev in ((host.ns, "eth0"), (self.bridge_ns, host.port)):
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                verb,
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                host.rate,
                "burst",
                BURST,
                "latency",
                LATENCY,
            )

    def set_rate(self, host: Host, rate: str) -> None:
        """Reshape `host`'s link to `rate` each way."""
        host.rate = rate
        self._shape(host, "change")

    def set_link(self, host: Host, up: bool) -> None:
        """Cut (or restore) `host`'s link at the bridge, as a pulled cable would: its address stays."""
        _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up" if up else "down")

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{h.address} {h.name}" for h in self.hosts.values())]
        for h in self.hosts.values():
            folder = NETNS_ETC / h.ns
            folder.mkdir(parents=True, exist_ok=True)
            # Rewritten in place: a running `ip netns exec` has this very file mounted over /etc/hosts.
            with open(folder / "hosts", "w") as f:
                f.write("\n".join(lines) + "\n")

    def close(self) -> None:
        """Stop what still runs inside, then delete every namespace (their veths go with them) and hosts file."""
        for ns in reversed(self._made):
            _delete(ns)
        self._made.clear()
