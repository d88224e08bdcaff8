"""Emulated slow hardware: a schedule of slowdown factors over wall time.

`4` or `4x` makes a node four times slower for the whole run;
`1x,4x@60s,1x@120s` makes it normal, then four times slower from 60 s, then
normal again from 120 s. A factor F idles (F-1) times the CPU time of each
compute step after it, so a node looks F times slower while using no more CPU:
this is how a heterogeneous cluster is reproduced on one machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_SLOWDOWN_CHARS = 64  # a schedule's text as HELLO may carry it
_ITEM = re.compile(r"^\s*(?P<factor>\d+(?:\.\d+)?)x?\s*(?:@\s*(?P<at>\d+(?:\.\d+)?)\s*s?)?\s*$")


@dataclass(frozen=True)
class Slowdown:
    """(start second, factor) pairs in time order; the first starts at 0."""

    phases: tuple[tuple[float, float], ...]

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        """Parse a schedule; raises ValueError with the offending item."""
        phases: list[tuple[float, float]] = []
        for i, item in enumerate(text.split(",")):
            m = _ITEM.match(item)
            if m is None:
                raise ValueError(f"slowdown {text!r}: cannot read {item!r} (expected like 2, 4x or 4x@60s)")
            factor = float(m["factor"])
            at = float(m["at"]) if m["at"] is not None else (0.0 if i == 0 else None)
            if at is None:
                raise ValueError(f"slowdown {text!r}: every item after the first needs @SECONDS")
            if factor < 1.0:
                raise ValueError(f"slowdown {text!r}: factor {factor} is below 1 (a node cannot be made faster)")
            if phases and at <= phases[-1][0]:
                raise ValueError(f"slowdown {text!r}: times must increase")
            phases.append((at, factor))
        if phases[0][0] != 0.0:
            phases.insert(0, (0.0, 1.0))
        return cls(tuple(phases))

    def label(self) -> str:
        """The schedule as one short text, as STATUS and the console show it: `2x`, `1x,4x@60s`."""
        return ",".join(f"{factor:g}x" + (f"@{at:g}s" if at else "") for at, factor in self.phases)

    def factor(self, elapsed_s: float) -> float:
        """The factor in force `elapsed_s` seconds after the worker started."""
        current = self.phases[0][1]
        for at, factor in self.phases:
            if elapsed_s >= at:
                current = factor
        return current
