"""A ROUTER socket in the test's own process that answers as the scheduler does, for tests of what a process
sends its scheduler and how it takes the answers (test_pulse.py, test_heartbeat_keeper.py): what goes on the
wire is read there."""

from __future__ import annotations

import threading

import zmq

from dynabatch.common.net.transport import recv_routed, send_routed
from dynabatch.common.wire.messages import Hello, Welcome
from harness import free_port


class SchedulerSocket:
    """A ROUTER, on a thread of its own, that welcomes every HELLO as member `w<n>`, keeps every other message it
    gets as (sender, body), and answers each with `answer` if one is set (an assignment, or an Error)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)
        self.got: list[tuple[str, object]] = []
        self.answer: object | None = None
        self.config: dict[str, object] = {}  # the job every WELCOME carries (a shard needs one)
        self.welcomed = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            if not self.sock.poll(10):
                continue
            msg = recv_routed(self.sock)
            if msg.message is None:  # undecodable: this stand-in has nothing to answer it with
                continue
            if isinstance(msg.message.body, Hello):
                welcome = Welcome(
                    id=f"w{self.welcomed}", config=self.config, shards=[], shard_index=msg.message.body.shard_index
                )
                send_routed(self.sock, msg.identity, welcome, msg.message.seq, "j", "scheduler")
                self.welcomed += 1
                continue
            self.got.append((msg.message.sender, msg.message.body))
            if self.answer is not None:
                send_routed(self.sock, msg.identity, self.answer, msg.message.seq, "j", "scheduler")

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()
        self.sock.close(linger=0)
