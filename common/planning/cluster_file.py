"""A cluster described in a JSON file: the one reader of the format, for the simulator (`python -m bench.simulate
--profile-file FILE.json`), `dynabatch plan --profile FILE.json` and `dynabatch check --save-profile FILE.json`.

    {"workers": [{"count": 12, "fixed_s": 0.02, "per_sample_s": 0.0008, "max_batch": 256, "link_mbit": 10000},
                 {"count": 4, "fixed_s": 0.01, "per_sample_s": 0.003, "max_batch": 64, "link_mbit": 1000,
                  "latency_s": 0.0005}],
     "model_bytes": 100000000, "global_batch": 1024, "shards": 2, "shard_mbit": 10000,
     "source": "where the figures come from"}

Each group of `count` workers has its step curve (`fixed_s + per_sample_s * b` seconds), its memory cap
(`max_batch`, 0: none) and its link (`link_mbit`, optional `latency_s`); optional per group: `slowdown` (a
schedule in common/slowdown.py's syntax, times its curve: a speed shift), `join_s`, `leave_s`. The job's
optional fields: `model_bytes` (on the wire, per pull or push; 0 or absent: the reader's default), `global_batch`,
`shards` and `shard_mbit` (each shard's service rate; 0 or absent: shards serve at once). `name`, `source` and
`notes` (text, on the cluster or on a group) say what the figures are and where they come from; any other key is
an error, so that a misspelt field is not silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynabatch.common.atomic_file import write_text_atomic
from dynabatch.common.planning.optimum import Device
from dynabatch.common.slowdown import Slowdown

TEXT_KEYS = ("name", "source", "notes")
GROUP_KEYS = (
    "count",
    "fixed_s",
    "per_sample_s",
    "max_batch",
    "link_mbit",
    "latency_s",
    "slowdown",
    "join_s",
    "leave_s",
    *TEXT_KEYS,
)
JOB_KEYS = ("workers", "model_bytes", "global_batch", "shards", "shard_mbit", *TEXT_KEYS)
REQUIRED = ("count", "fixed_s", "per_sample_s", "link_mbit")


class ClusterFileError(ValueError):
    """A cluster file that cannot describe a cluster; the message names the file and the field."""


@dataclass(frozen=True)
class WorkerGroup:
    """`count` workers alike: their step curve and cap, their link to the shards, when they join and leave."""

    count: int
    device: Device
    link_mbit: float
    latency_s: float = 0.0
    slowdown: str = "1"
    join_s: float = 0.0
    leave_s: float = math.inf


@dataclass(frozen=True)
class ClusterFile:
    """What a cluster file describes: the worker groups and the job's transfer settings."""

    name: str
    groups: tuple[WorkerGroup, ...]
    model_bytes: float = 0.0
    global_batch: int = 0
    shards: int = 1
    shard_mbit: float = 0.0

    def workers(self) -> list[WorkerGroup]:
        """One entry per worker (a group of `count` repeated)."""
        return [g for g in self.groups for _ in range(g.count)]


def _number(where: str, key: str, value: Any, low: float, integer: bool = False, above: bool = False) -> float:
    """`value` as a finite number >= `low` (> `low` where `above`), an integer where `integer`."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        raise ClusterFileError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < low or (above and value == low):
        raise ClusterFileError(f"{where}: {key} must be {'>' if above else '>='} {low:g}, got {value!r}")
    return float(value)


def _unknown(where: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise ClusterFileError(f"{where}: unknown field(s) {', '.join(extra)} (known: {', '.join(allowed)})")


def _group(where: str, g: Any) -> WorkerGroup:
    if not isinstance(g, dict):
        raise ClusterFileError(f"{where}: a worker group must be an object, got {type(g).__name__}")
    _unknown(where, g, GROUP_KEYS)
    missing = [k for k in REQUIRED if k not in g]
    if missing:
        raise ClusterFileError(f"{where}: missing {', '.join(missing)}")
    join = _number(where, "join_s", g.get("join_s", 0.0), 0.0)
    slowdown = str(g.get("slowdown", "1"))
    try:
        Slowdown.parse(slowdown)
    except ValueError as exc:
        raise ClusterFileError(f"{where}: {exc}") from None
    device = Device(
        _number(where, "fixed_s", g["fixed_s"], 0.0),
        _number(where, "per_sample_s", g["per_sample_s"], 0.0, above=True),
        int(_number(where, "max_batch", g.get("max_batch", 0), 0, integer=True)),
    )
    return WorkerGroup(
        count=int(_number(where, "count", g["count"], 1, integer=True)),
        device=device,
        link_mbit=_number(where, "link_mbit", g["link_mbit"], 0.0, above=True),
        latency_s=_number(where, "latency_s", g.get("latency_s", 0.0), 0.0),
        slowdown=slowdown,
        join_s=join,
        leave_s=math.inf if "leave_s" not in g else _number(where, "leave_s", g["leave_s"], join, above=True),
    )


def _document(text: str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterFileError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ClusterFileError(f'{where}: must be a JSON object with a "workers" list')
    return doc


def parse_cluster(text: str, where: str = "cluster file") -> ClusterFile:
    """The cluster a file's text describes; raises ClusterFileError naming `where` and the field."""
    doc = _document(text, where)
    _unknown(where, doc, JOB_KEYS)
    groups = doc.get("workers")
    if not isinstance(groups, list) or not groups:
        raise ClusterFileError(f'{where}: "workers" must be a non-empty list of worker groups')
    for key in TEXT_KEYS:
        if key in doc and not isinstance(doc[key], str):
            raise ClusterFileError(f"{where}: {key} must be text")
    parsed = tuple(_group(f"{where}: workers[{i}]", g) for i, g in enumerate(groups))
    if not any(g.join_s == 0 for g in parsed):
        raise ClusterFileError(f"{where}: no worker starts at 0 (every group has a join_s)")
    return ClusterFile(
        name=str(doc.get("name", where)),
        groups=parsed,
        model_bytes=_number(where, "model_bytes", doc.get("model_bytes", 0), 0.0),
        global_batch=int(_number(where, "global_batch", doc.get("global_batch", 0), 0, integer=True)),
        shards=int(_number(where, "shards", doc.get("shards", 1), 1, integer=True)),
        shard_mbit=_number(where, "shard_mbit", doc.get("shard_mbit", 0.0), 0.0),
    )


def read_cluster(path: str | Path) -> ClusterFile:
    """The cluster described in the file at `path` (see the module's docstring for the format)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ClusterFileError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_cluster(text, str(path))


def add_group(path: str | Path, group: dict[str, Any], job: dict[str, Any]) -> ClusterFile:
    """Append one worker group to the cluster file at `path` (made if absent), the job's fields filled where the
    file has none, so that several machines' probes gather in one file. The result is parsed before it is written:
    a group or file that does not fit the format raises ClusterFileError and the file is left as it was."""
    target = Path(path)
    doc: dict[str, Any] = {"workers": []}
    if target.exists():
        try:
            doc = _document(target.read_text(), str(target))
        except OSError as exc:
            raise ClusterFileError(f"{target}: cannot read ({exc.strerror})") from None
        if not isinstance(doc.get("workers"), list):
            raise ClusterFileError(f'{target}: "workers" must be a list of worker groups')
    doc["workers"] = [*doc["workers"], group]
    for key, value in job.items():
        doc.setdefault(key, value)
    text = json.dumps(doc, indent=1)
    parsed = parse_cluster(text, str(target))
    write_text_atomic(target, text + "\n")
    return parsed
