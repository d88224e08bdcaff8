"""A cluster described in a JSON file, for the simulator (`python -m bench.simulate --profile-file FILE.json`).

    {"workers": [{"count": 12, "fixed_s": 0.02, "per_sample_s": 0.0008, "max_batch": 256, "link_mbit": 10000},
                 {"count": 4, "fixed_s": 0.01, "per_sample_s": 0.003, "max_batch": 64, "link_mbit": 1000,
                  "latency_s": 0.0005}],
     "model_bytes": 100000000, "global_batch": 1024, "shards": 2, "shard_mbit": 10000,
     "source": "where the figures come from"}

Each group of `count` workers has its step curve (`fixed_s + per_sample_s * b` seconds), its memory cap
(`max_batch`, 0: none) and its link (`link_mbit`, optional `latency_s`); optional per group: `slowdown` (a
schedule in common/slowdown.py's syntax, times its curve: a speed shift), `join_s`, `leave_s`. The job's
optional fields: `model_bytes` (on the wire, per pull or push; default: the simulated model's), `global_batch`,
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

from bench.simulate import WorkerSpec
from dynabatch.common.slowdown import Slowdown

TEXT_KEYS = ("name", "source", "notes")
GROUP_KEYS = ("count", "fixed_s", "per_sample_s", "max_batch", "link_mbit", "latency_s", "slowdown", "join_s",
              "leave_s", *TEXT_KEYS)
JOB_KEYS = ("workers", "model_bytes", "global_batch", "shards", "shard_mbit", *TEXT_KEYS)
REQUIRED = ("count", "fixed_s", "per_sample_s", "link_mbit")


class ProfileError(ValueError):
    """A profile file that cannot describe a cluster; the message names the file and the field."""


@dataclass(frozen=True)
class ClusterProfile:
    """What a profile file describes: the workers and the job's transfer settings (SimConfig's fields)."""

    name: str
    workers: tuple[WorkerSpec, ...]
    wire_bytes: float = 0.0
    global_batch: int = 0
    shards: int = 1
    shard_mbit: float = 0.0

    def sim_settings(self) -> dict[str, Any]:
        """The SimConfig fields this profile sets (the global batch is the caller's: it has its own default)."""
        return {"wire_bytes": self.wire_bytes, "shards": self.shards, "shard_mbit": self.shard_mbit}


def _number(where: str, key: str, value: Any, low: float, integer: bool = False, above: bool = False) -> float:
    """`value` as a finite number >= `low` (> `low` where `above`), an integer where `integer`."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        raise ProfileError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value < low or (above and value == low):
        raise ProfileError(f"{where}: {key} must be {'>' if above else '>='} {low:g}, got {value!r}")
    return float(value)


def _unknown(where: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(extra)} (known: {', '.join(allowed)})")


def _group(where: str, g: Any) -> list[WorkerSpec]:
    if not isinstance(g, dict):
        raise ProfileError(f"{where}: a worker group must be an object, got {type(g).__name__}")
    _unknown(where, g, GROUP_KEYS)
    missing = [k for k in REQUIRED if k not in g]
    if missing:
        raise ProfileError(f"{where}: missing {', '.join(missing)}")
    count = int(_number(where, "count", g["count"], 1, integer=True))
    fixed = _number(where, "fixed_s", g["fixed_s"], 0.0)
    per_sample = _number(where, "per_sample_s", g["per_sample_s"], 0.0, above=True)
    cap = int(_number(where, "max_batch", g.get("max_batch", 0), 0, integer=True))
    link = _number(where, "link_mbit", g["link_mbit"], 0.0, above=True)
    latency = _number(where, "latency_s", g.get("latency_s", 0.0), 0.0)
    join = _number(where, "join_s", g.get("join_s", 0.0), 0.0)
    leave = math.inf if "leave_s" not in g else _number(where, "leave_s", g["leave_s"], join, above=True)
    slowdown = g.get("slowdown", "1")
    try:
        Slowdown.parse(str(slowdown))
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    spec = WorkerSpec(str(slowdown), join_s=join, leave_s=leave, fixed_s=fixed,
                      per_sample_s=per_sample, max_batch=cap, link_mbit=link, latency_s=latency)
    return [spec] * count


def parse_profile(text: str, where: str = "profile") -> ClusterProfile:
    """The cluster a profile file's text describes; raises ProfileError naming `where` and the field."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{where}: must be a JSON object with a \"workers\" list")
    _unknown(where, doc, JOB_KEYS)
    groups = doc.get("workers")
    if not isinstance(groups, list) or not groups:
        raise ProfileError(f"{where}: \"workers\" must be a non-empty list of worker groups")
    for key in TEXT_KEYS:
        if key in doc and not isinstance(doc[key], str):
            raise ProfileError(f"{where}: {key} must be text")
    workers = [w for i, g in enumerate(groups) for w in _group(f"{where}: workers[{i}]", g)]
    if not any(w.join_s == 0 for w in workers):
        raise ProfileError(f"{where}: no worker starts at 0 (every group has a join_s)")
    return ClusterProfile(
        name=str(doc.get("name", where)), workers=tuple(workers),
        wire_bytes=_number(where, "model_bytes", doc.get("model_bytes", 0), 0.0),
        global_batch=int(_number(where, "global_batch", doc.get("global_batch", 0), 0, integer=True)),
        shards=int(_number(where, "shards", doc.get("shards", 1), 1, integer=True)),
        shard_mbit=_number(where, "shard_mbit", doc.get("shard_mbit", 0.0), 0.0))


def read_profile(path: str | Path) -> ClusterProfile:
    """The cluster described in the file at `path` (see the module's docstring for the format)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_profile(text, str(path))
