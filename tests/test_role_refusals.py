"""A role started with a port it cannot have or an endpoint that is not one: exit 2 with one line, no traceback.

`dynabatch run` reads these lines back: a scheduler's or shard's port taken at its
first start moves it to another (tests/test_child_failures.py), and any other exit 2
ends the run with the line (cluster/restart_policy.py).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from dynabatch.common.flags import ConfigError
from dynabatch.common.net.endpoint import check_endpoint
from hang_guard import hang_guard_s
from harness import child_env, command_line, free_port


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    yield int(s.getsockname()[1])
    s.close()


def refused(command: str, flags: list[str]) -> str:
    """Start `dynabatch COMMAND FLAGS`; its last stderr line, once it exited 2 without a traceback."""
    done = subprocess.run(
        command_line(command, flags), capture_output=True, text=True, timeout=hang_guard_s(120), env=child_env()
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.splitlines()[-1]


def test_a_scheduler_whose_port_is_taken_says_so_in_one_line(taken: int) -> None:
    assert refused("scheduler", ["--bind", f"tcp://127.0.0.1:{taken}"]) == (
        f"dynabatch scheduler: --bind tcp://127.0.0.1:{taken}: Address already in use"
    )


def test_a_shard_whose_port_is_taken_says_so_in_one_line(taken: int) -> None:
    assert refused("ps", ["--bind", f"tcp://127.0.0.1:{taken}"]) == (
        f"dynabatch ps: --bind tcp://127.0.0.1:{taken}: Address already in use"
    )


@pytest.mark.parametrize("command", ["scheduler", "ps"])
def test_a_taken_metrics_port_is_one_line(taken: int, command: str) -> None:
    assert refused(command, ["--bind", "tcp://127.0.0.1:0", "--metrics-port", str(taken)]) == (
        f"dynabatch {command}: --metrics-host 127.0.0.1 --metrics-port {taken}: Address already in use"
    )


@pytest.mark.parametrize(
    "command, flag", [("scheduler", "--bind"), ("ps", "--bind"), ("ps", "--scheduler"), ("worker", "--scheduler")]
)
def test_an_endpoint_without_its_scheme_is_refused_as_a_flag(command: str, flag: str) -> None:
    assert refused(command, [flag, "127.0.0.1:5555"]) == (
        f"dynabatch {command}: error: {flag} 127.0.0.1:5555: expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555"
    )


@pytest.mark.parametrize(
    "endpoint, ok",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://0.0.0.0:0", True),
        ("tcp://[::1]:5555", True),
        ("tcp://ps-0.ps:5600", True),
        ("tcp://*:5555", True),
        ("tcp://127.0.0.1:*", True),
        ("127.0.0.1:5555", False),
        ("tcp://127.0.0.1", False),
        ("tcp://127.0.0.1:70000", False),
        ("udp://127.0.0.1:5555", False),
        ("", False),
    ],
)
def test_an_endpoint_is_tcp_host_and_port(endpoint: str, ok: bool) -> None:
    if ok:
        check_endpoint("--bind", endpoint)
    else:
        with pytest.raises(ConfigError, match="expected tcp://HOST:PORT"):
            check_endpoint("--bind", endpoint)
