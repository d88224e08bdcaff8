"""Connections that complete ZeroMQ's handshake and then hold their descriptor: anyone who reaches a port can.

Each sends the 94 bytes a ZeroMQ DEALER sends on connecting without CURVE
(ZMTP 3.0's greeting and its NULL mechanism's READY), so the server takes it for a
peer and keeps its connection (and a descriptor) until it stops answering ZMTP
PINGs. About 20,000 of them once took the scheduler to its descriptor limit.

`PYTHONPATH=tests python -m fuzz.greeting_flood --to tcp://127.0.0.1:PORT --connections 20000 --pid PID`
floods a running server and prints its descriptors and memory before, during and after (issue 22).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# ZMTP 3.0: signature, version 3.0, mechanism NULL (padded to 20 bytes), as-server 0, 31 bytes of filler.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY  # a short command frame
HANDSHAKE = GREETING + READY


def open_flood(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections to host:port, each having sent HANDSHAKE; a connection the server refuses still counts
    (its socket is open here until `close_flood`)."""
    flood = []
    for _ in range(count):
        # A server busy with a full accept queue drops the SYN; the kernel retries it at 1, 3, 7, 15 and 31 s, and
        # 10 s allowed only three of those tries (a run of the suite alone once timed out so).
        conn = socket.create_connection((host, port), timeout=60)
        try:
            conn.sendall(HANDSHAKE)
        except OSError:  # the server shut it down already
            pass
        flood.append(conn)
    return flood


def close_flood(flood: Sequence[socket.socket]) -> None:
    for conn in flood:
        conn.close()


def shut_down_by_server(flood: Sequence[socket.socket]) -> int:
    """How many of the flood's connections the server has shut down: past what it sent (its own greeting), each
    reads end-of-file or a reset. Reads what waits on every connection."""
    shut = 0
    for conn in flood:
        conn.setblocking(False)
        try:
            while conn.recv(4096):
                pass
            shut += 1
        except BlockingIOError:
            pass
        except OSError:
            shut += 1
    return shut


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuzz.greeting_flood", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--to", required=True, help="the server's endpoint, tcp://HOST:PORT")
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (its /proc is read)")
    parser.add_argument("--hold-s", type=float, default=5.0, help="how long to hold the flood open")
    args = parser.parse_args(argv)
    host, _, port = args.to.removeprefix("tcp://").rpartition(":")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def show(when: str) -> None:
        print(f"{when}: {descriptors(args.pid)} descriptors, {rss_mb(args.pid):.0f} MB resident", flush=True)

    show("before")
    start = time.monotonic()
    flood = open_flood(host, int(port), args.connections)
    print(f"opened {len(flood)} connections in {time.monotonic() - start:.1f}s", flush=True)
    time.sleep(args.hold_s)  # a measurement, not a synchronisation: what the server holds while the flood stays
    show("during")
    print(f"shut down by the server: {shut_down_by_server(flood)}", flush=True)
    close_flood(flood)
    time.sleep(args.hold_s)
    show("after")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
