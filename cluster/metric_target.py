"""A target on one evaluation metric, `accuracy>=0.9` or `loss<=0.3`: time to target is time to the first hit.

Any metric the task reports can be the target, in either direction; the
direction is written out rather than guessed from the name, since only the
task knows whether more of its metric is better.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dynabatch.common.wire.eval_bounds import metric_name_problem

_FORM = re.compile(r"^(?P<name>.*?)(?P<op>>=|<=)(?P<value>.*)$")


@dataclass(frozen=True)
class MetricTarget:
    """`name` `op` `value`: met by an evaluation whose metric `name` is at least (>=) or at most (<=) `value`."""

    name: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> MetricTarget:
        """`accuracy>=0.9` (spaces around the operator allowed); ValueError saying what is wrong."""
        form = _FORM.match(text)
        if form is None:
            raise ValueError(f"{text!r} is not METRIC>=VALUE or METRIC<=VALUE (e.g. accuracy>=0.9, loss<=0.3)")
        name, op, number = form["name"].strip(), form["op"], form["value"].strip()
        problem = metric_name_problem(name)
        if problem:
            raise ValueError(f"{text!r}: {problem}")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"{text!r}: {number!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{text!r}: the target value must be finite")
        return cls(name, op, value)

    def met(self, value: float | None) -> bool:
        """Whether a metric's `value` meets the target (never when missing or NaN)."""
        if value is None or math.isnan(value):
            return False
        return value >= self.value if self.op == ">=" else value <= self.value

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}"
