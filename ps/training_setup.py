"""What the first INIT fixes for a whole job: the model's signature, and the optimizer and schedule.

The shards step with the first worker's optimizer and schedule; a later worker whose
task names others would compute as if its own applied, so its INIT is refused with
the difference named, as a model of another shape is. A shard writes the set-up
into its checkpoint and takes it back from there when it restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynabatch.common.wire.messages import Init
from dynabatch.common.wire.model_signature import ModelSignature, signature_fields, signature_from_fields
from dynabatch.schedule import schedule_from_fields


@dataclass(frozen=True)
class TrainingSetup:
    """The model's signature and the wire fields of the optimizer and schedule the shards step with (empty: the
    job's SGD flags, a constant rate)."""

    signature: ModelSignature
    optimizer: dict[str, Any]
    schedule: dict[str, Any]

    @classmethod
    def from_init(cls, body: Init) -> TrainingSetup:
        """The set-up an INIT describes; ValueError naming what is malformed (the optimizer's fields are checked
        against the job by the caller, update_rules.optimizer_spec)."""
        sig = signature_from_fields(
            body.names,
            body.shapes,
            body.dtypes,
            body.train_size,
            body.buffer_names,
            body.buffer_shapes,
            body.buffer_dtypes,
        )
        schedule_from_fields(body.schedule)
        return cls(sig, body.optimizer, body.schedule)

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any]) -> TrainingSetup:
        """The set-up this shard wrote into its checkpoint (`checkpoint_fields`)."""
        return cls(signature_from_fields(**saved["signature"]), saved["optimizer"], saved["schedule"])

    def checkpoint_fields(self) -> dict[str, Any]:
        return {"signature": signature_fields(self.signature), "optimizer": self.optimizer, "schedule": self.schedule}

    def difference(self, other: TrainingSetup) -> str | None:
        """A sentence naming the first way `other` (a later worker's) differs from this (the job's), or None."""
        return other.signature.difference(self.signature) or setup_difference(
            {"optimizer": self.optimizer, "schedule": self.schedule},
            {"optimizer": other.optimizer, "schedule": other.schedule},
        )


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
            return f"{part}: {named} task names {which.get('name', part)}, {unnamed} none (the job's flags)"
        keys = sorted(set(ours) | set(theirs))
        diffs = [
            f"{k} {ours.get(k)!r} (job) != {theirs.get(k)!r} (this worker)"
            for k in keys
            if ours.get(k) != theirs.get(k)
        ]
        return f"{part}: " + ", ".join(diffs)
    return None
