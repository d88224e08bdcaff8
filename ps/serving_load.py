"""How busy a shard is with the workers' pulls and pushes: the seconds it spent serving them and the seconds they
waited for it first, reported cumulatively in its heartbeat (ShardHeartbeat.busy_s, queued_s), with the count of
the messages served and the sum of their serving seconds' squares (`served`, `busy_sq_s`): a queue's wait grows
with the spread of its service times as well as their mean (Pollaczek-Khinchine), and a shard that shares its cores
with the workers it serves is sometimes slow, so a reader who models its queue needs both. `transfers` counts what
they moved in whole parts of the model it holds: each chunk it sent and each push it took, by their share of its
elements (a pull or push of every chunk is 1). A message is no measure of that, since a gradient step's push carries
the next pull and a pipelined push goes as several messages, and a push the protocol refused moved nothing.

A worker measures its pull and push as one span, its link and the shard's queue together. Under `--protocol auto` the
scheduler tells them apart with these figures (scheduler/measured_cluster.py): a shard that bounds the job makes every
worker's transfers long whatever its link, and local SGD, which moves the model once per round, is the cure only the
shard's share shows. The shard's own count of transfers gives its service time from its first heartbeat after the first
pulls, before any worker has reported a step. A message's wait is counted from the poll that took it off the socket to
the start of its handling (the messages of one poll are served in priority order); time it spent in the socket's own
queue is not seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dynabatch.common.wire.messages import Pull, Push

SERVED = frozenset({Pull.TYPE, Push.TYPE})


@dataclass
class ServingLoad:
    """The seconds the shard spent serving pulls and pushes and the seconds they waited, since it started; how many
    it served, the sum of the squares of each one's serving seconds, the parts of the model they moved, and the
    workers whose push has reached it."""

    busy_s: float = 0.0
    queued_s: float = 0.0
    busy_sq_s: float = 0.0
    served_count: int = 0
    transfers: float = 0.0
    pushers: set[str] = field(default_factory=set)

    def moved(self, elements: int, total: int) -> None:
        """`elements` of the shard's `total` went out in a chunk it sent or came in with a push it took."""
        if total > 0:
            self.transfers += elements / total

    def pushed_by(self, workers: Iterable[str]) -> None:
        """Pushes of these live workers, each from its own connection, reached the shard, as read off its socket
        ("": no one's)."""
        self.pushers.update(w for w in workers if w)

    def served(self, kind: str, received: float, started: float, ended: float) -> None:
        """A message of type `kind` taken off the socket at `received`, handled from `started` to `ended`
        (monotonic seconds); only pulls and pushes count."""
        if kind in SERVED:
            busy = max(0.0, ended - started)
            self.queued_s += max(0.0, started - received)
            self.busy_s += busy
            self.busy_sq_s += busy * busy
            self.served_count += 1
