"""How the console, the final table and the plots name a worker: `worker1(2x)`, in one order.

The scheduler's ids (`w0`, `w1`, ...) number workers as they join, which on a
loaded machine is not the order they were launched in; a reader needs the name
each worker was given and, where the run emulates slow machines, its slowdown.
Every place that lists workers orders them by name, numbers compared as numbers
(`worker2` before `worker10`): `dynabatch run`'s `workerI` is the I-th of
`--slowdowns`, so the order is the one given there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from dynabatch.common.wire.messages import WorkerStatus


def order_key(name: str, wid: str) -> tuple[list[int | str], list[int | str]]:
    """Sorts by name, then by id (a restarted worker keeps its name under a new id), numbers as numbers."""
    return _natural(name), _natural(wid)


def _natural(text: str) -> list[int | str]:
    # re.split with a group alternates text and digits, so the same positions always hold the same type.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def emulated(slowdowns: Iterable[str]) -> bool:
    """Whether any worker emulates a slower machine: otherwise the labels leave the slowdowns (all 1x) out."""
    return any(s not in ("", "1x") for s in slowdowns)


def label(name: str, slowdown: str, show_slowdown: bool) -> str:
    """`worker1(2x)`, or the bare name where no slowdown is shown (or none was reported)."""
    return f"{name}({slowdown})" if show_slowdown and slowdown else name


def labelled(workers: Mapping[str, WorkerStatus], show_slowdown: bool = False) -> list[tuple[str, str]]:
    """(id, label) of each worker in a STATUS, in `order_key`'s order; a name two live workers share gets its id.
    Slowdowns are shown where `show_slowdown` (the job was launched emulating slower machines: its labels stay the same
    while the workers leave one by one, the 1x one last) or where a listed worker emulates one."""
    show = show_slowdown or emulated(w.slowdown for w in workers.values())
    names = [w.name for w in workers.values()]
    ordered = sorted(workers.items(), key=lambda item: order_key(item[1].name, item[0]))
    return [
        (wid, label(w.name, w.slowdown, show) + (f"[{wid}]" if names.count(w.name) > 1 else "")) for wid, w in ordered
    ]
