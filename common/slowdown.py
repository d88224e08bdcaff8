"""Emulated slow hardware: a schedule of slowdown factors over wall time.

`4` or `4x` makes a node four times slower for the whole run;
`1x,4x@60s,1x@120s` makes it normal, then four times slower from 60 s, then
normal again from 120 s. A factor F idles (F-1) times the CPU time of each
compute step after it, so a node looks F times slower while using no more CPU:
this is how a heterogeneous cluster is reproduced on one machine.

A device's step is a fixed cost plus a cost per sample, and devices differ in
both (a GPU's fixed cost is large against its per-sample cost, a CPU's small):
`F:A` (or `Fx:As`) idles A seconds more after each step, so the node's step is
F times its CPU time plus A, the same shape as the simulator's per-worker curve
(bench/cluster_model.py). `1x:0.05s,4x:0.05s@60s` keeps the fixed part and
slows the rest from 60 s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_SLOWDOWN_CHARS = 64  # a schedule's text as HELLO may carry it
_NUMBER = r"\d+(?:\.\d+)?"
_ITEM = re.compile(
    rf"^\s*(?P<factor>{_NUMBER})x?\s*(?::\s*(?P<fixed>{_NUMBER})\s*s?)?\s*"
    rf"(?:@\s*(?P<at>{_NUMBER})\s*s?)?\s*$"
)


@dataclass(frozen=True)
class Slowdown:
    """(start second, factor, fixed seconds per step) in time order; the first starts at 0."""

    phases: tuple[tuple[float, float, float], ...]

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        """Parse a schedule; raises ValueError with the offending item."""
        phases: list[tuple[float, float, float]] = []
        for i, item in enumerate(text.split(",")):
            m = _ITEM.match(item)
            if m is None:
                raise ValueError(f"slowdown {text!r}: cannot read {item!r} (expected like 2, 4x, 4x@60s or 4x:0.05s)")
            factor = float(m["factor"])
            at = float(m["at"]) if m["at"] is not None else (0.0 if i == 0 else None)
            if at is None:
                raise ValueError(f"slowdown {text!r}: every item after the first needs @SECONDS")
            if factor < 1.0:
                raise ValueError(f"slowdown {text!r}: factor {factor} is below 1 (a node cannot be made faster)")
            if phases and at <= phases[-1][0]:
                raise ValueError(f"slowdown {text!r}: times must increase")
            phases.append((at, factor, float(m["fixed"] or 0.0)))
        if phases[0][0] != 0.0:
            phases.insert(0, (0.0, 1.0, 0.0))
        return cls(tuple(phases))

    def label(self) -> str:
        """The schedule as one short text, as STATUS and the console show it: `2x`, `1x,4x@60s`, `2x:0.05s`."""
        return ",".join(
            f"{factor:g}x" + (f":{fixed:g}s" if fixed else "") + (f"@{at:g}s" if at else "")
            for at, factor, fixed in self.phases
        )

    def _phase(self, elapsed_s: float) -> tuple[float, float, float]:
        current = self.phases[0]
        for phase in self.phases:
            if elapsed_s >= phase[0]:
                current = phase
        return current

    def factor(self, elapsed_s: float) -> float:
        """The factor in force `elapsed_s` seconds after the worker started."""
        return self._phase(elapsed_s)[1]

    def fixed_s(self, elapsed_s: float) -> float:
        """The fixed seconds added to each step `elapsed_s` seconds after the worker started."""
        return self._phase(elapsed_s)[2]

    def idle_s(self, elapsed_s: float, cpu_s: float) -> float:
        """What a step of `cpu_s` CPU seconds idles after it: (F - 1) times its CPU time, plus the fixed part."""
        _, factor, fixed = self._phase(elapsed_s)
        return max(0.0, factor - 1.0) * cpu_s + fixed
