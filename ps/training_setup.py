"""The optimizer and schedule a job trains with, as the first INIT set them: part of the job's signature.

The shards step with the first worker's optimizer and schedule; a later worker whose
task names others would compute as if its own applied, so its INIT is refused with
the difference named, as a model of another shape is.
"""

from __future__ import annotations

from typing import Any


def setup_difference(job: dict[str, dict[str, Any]], worker: dict[str, dict[str, Any]]) -> str | None:
    """What differs between the job's {"optimizer": ..., "schedule": ...} wire fields and a worker's, or None.

    Empty fields mean the job's own SGD (from its flags) and a constant rate: a worker whose task names
    none differs from a job whose first worker named one.
    """
    for part in ("optimizer", "schedule"):
        ours, theirs = job.get(part) or {}, worker.get(part) or {}
        if ours == theirs:
            continue
        if not ours or not theirs:
            named, unnamed = ("the job's", "this worker's") if ours else ("this worker's", "the job's")
            which = ours or theirs
            return (f"{part}: {named} task names {which.get('name', part)}, {unnamed} none (the job's flags)")
        keys = sorted(set(ours) | set(theirs))
        diffs = [f"{k} {ours.get(k)!r} (job) != {theirs.get(k)!r} (this worker)" for k in keys
                 if ours.get(k) != theirs.get(k)]
        return f"{part}: " + ", ".join(diffs)
    return None
