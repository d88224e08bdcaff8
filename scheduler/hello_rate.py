"""How fast one source may register new members: a token bucket per peer address.

`--max-workers` caps how many members are present at once; this caps how fast a
source can churn through registrations (HELLO, BYE, HELLO ...), each of which
costs the whole job a membership change (the shards' rounds wait on the new set).
Only a HELLO that would register a new member spends a token: a HELLO repeated by
the same process (a re-join after a dropped connection), one refused because the
shards are not up yet, and one refused as `full` are free, so a normal start and
legitimate re-joins never meet the limit. The default burst lets one machine fill
the whole job twice over at once (`dynabatch run` starts everything from one
address); after that a source earns `per_s` registrations a second.

The table of sources is bounded: past `max_sources` the sources whose bucket has
refilled are forgotten first (forgetting them changes nothing), then the oldest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError

MAX_SOURCES = 4096


@dataclass
class HelloRate:
    """Registrations per source: up to `burst` at once, then `per_s` a second."""

    per_s: float
    burst: float
    max_sources: int = MAX_SOURCES
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # source -> (tokens, at)

    def tokens(self, source: str, now: float) -> float:
        """The registrations `source` may make at `now`."""
        tokens, at = self._buckets.get(source, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.per_s)

    def spend(self, source: str, now: float) -> None:
        """Take one registration from `source`'s bucket, or refuse (`hello_rate`) when it has none left."""
        tokens = self.tokens(source, now)
        if tokens < 1.0:
            wait = (1.0 - tokens) / self.per_s
            raise ProtocolError(
                ErrorCode.HELLO_RATE,
                f"{source or 'this source'} registered more than {self.burst:.0f} "
                f"members at once or {self.per_s:g} a second; retry in {wait:.1f} s",
            )
        self._buckets.pop(source, None)
        self._buckets[source] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_sources:
            self._forget(now)

    def _forget(self, now: float) -> None:
        for source in [s for s in self._buckets if self.tokens(s, now) >= self.burst]:
            del self._buckets[source]
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
