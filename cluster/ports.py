"""Free TCP ports for processes that must be told their port before they start.

`bind(port 0)` returns a port from the kernel's ephemeral range, the same range
the kernel hands to every outgoing connection and every `bind(0)` (ZeroMQ's
`tcp://host:*` included). Between our probe and the child's own bind, any of
those can take it ("Address already in use"). Ports below that range are only
ever taken by someone who asked for them by number, so a probe there stays good.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # above the well-known and most registered service ports
ATTEMPTS = 200


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, outside the ephemeral range when there is room."""
    top = _ephemeral_start()
    if top - LOWEST < 1000:  # a system whose ephemeral range starts low: fall back to asking the kernel
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for _ in range(ATTEMPTS):
        port = random.randrange(LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in {LOWEST}-{top - 1} after {ATTEMPTS} tries")
