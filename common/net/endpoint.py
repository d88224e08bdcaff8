"""The form of an endpoint flag (`--bind`, `--scheduler`, `--advertise`): tcp://HOST:PORT, checked as a flag.

ZeroMQ refuses `127.0.0.1:5555` with "Protocol not supported" from deep inside a
socket call; checked here, it is one line naming the flag before anything starts.
"""

from __future__ import annotations

import re

from dynabatch.common.flags import ConfigError

_TCP = re.compile(r"tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5}|\*)")


def check_endpoint(flag: str, value: str) -> None:
    """ConfigError unless `value` is tcp://HOST:PORT (PORT 0-65535, or * for any)."""
    m = _TCP.fullmatch(value)
    if m is None or (m["port"] != "*" and int(m["port"]) > 65535):
        raise ConfigError(f"{flag} {value}: expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555")
