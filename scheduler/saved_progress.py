"""The job's progress on disk, so that a restarted scheduler resumes the job rather than restarting it.

Everything the scheduler has learned that no other process can tell it again:
the samples trained (workers report only what they did since they registered),
the samples counted back for shards that lost work, the training set's size,
the time trained (for the time budget), the latest evaluation, the id counters
(so a rejoining worker never gets the id of one still known under it), the
speed models (by the process's HELLO instance, so a worker that rejoins keeps
its fitted model), and each shard slot's newest version (so a shard restarted
while the scheduler was down is still caught losing work), and the job's rollbacks
(so a diverged job's smaller step size, and its count towards --max-rollbacks,
survive a restart). Members themselves
are not saved: every process registers again with a restarted scheduler.

The file is checksummed and written atomically, the copy it replaces kept as
`.prev` (common/verified_files.py). A copy that fails its checksum or holds a
figure that cannot be (a negative count, a non-finite time) is refused with one
line and the previous copy is read instead; with no good copy, or a file written
for another job or another configuration, the scheduler does not start: never a
silent start from zero.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynabatch.common.verified_files import DamagedFile, load_newest_good, write_verified
from dynabatch.common.wire.messages import EvalReport, Rollback
from dynabatch.scheduler.lost_work import ShardMark

FORMAT = 1
log = logging.getLogger("dynabatch.scheduler")


@dataclass
class SavedSpeed:
    """A worker's speed model: its standalone speed and the (batch, seconds) steps in its window."""

    standalone_sps: float
    observations: list[tuple[int, float]]


@dataclass
class SavedProgress:
    """What a restarted scheduler needs to go on with the same job (see the module's docstring)."""

    config: dict[str, Any]
    saved_at: float | None = None  # wall-clock (time.time()): the downtime until a resume is job time
    saved_boot_id: str = ""  # the machine's boot, and the time since it: the downtime if the boot is the same
    saved_boot_s: float | None = None
    t: float = 0.0
    samples: int = 0
    lost_samples: int = 0
    lost_versions: int = 0
    train_size: int = 0
    training_s: float | None = None
    assignment_id: int = 0
    next_id: dict[str, int] = field(default_factory=dict)
    local_steps: int = 0
    local_steps_reason: str = ""
    loss: float | None = None
    first_loss: float | None = None
    eval: EvalReport | None = None
    eval_time: float = 0.0
    eval_model_time: float | None = None  # None in a file saved before it was kept: eval_time stands for it
    final_eval: bool = False
    budget_spent: bool = False
    shard_marks: dict[int, ShardMark] = field(default_factory=dict)
    speeds: dict[str, SavedSpeed] = field(default_factory=dict)
    rollbacks: list[Rollback] = field(default_factory=list)
    protocol: str = ""  # --protocol auto: the protocol the workers stepped under ("": a protocol given by name)


def progress_path(state_dir: str, job: str) -> Path:
    return Path(state_dir) / f"scheduler-{job}.json"


def save_progress(path: Path, progress: SavedProgress) -> None:
    """Write `progress` to `path` atomically, under its checksum, keeping the previous copy."""
    write_verified(path, json.dumps({"format": FORMAT, **asdict(progress)}).encode())


def load_progress(path: Path, config: dict[str, Any]) -> SavedProgress | None:
    """The progress of the newest good copy of `path` for the job `config` describes; None if there is no file.

    Raises ValueError naming the file and what is wrong with it: no good copy
    (unreadable, damaged, another format), or another job (the settings that differ).
    """
    try:
        saved = load_newest_good(path, _parse, log.error)
    except DamagedFile as exc:
        raise ValueError(
            f"the scheduler's saved progress cannot be read ({exc}); remove {path} to start the job from zero"
        ) from None
    if saved is None:
        return None
    expected = json.loads(json.dumps(config))
    differ = sorted(k for k in expected.keys() | saved.config.keys() if expected.get(k) != saved.config.get(k))
    if differ:
        shown = ", ".join(f"{k}={saved.config.get(k)!r} (now {expected.get(k)!r})" for k in differ[:5])
        raise ValueError(
            f"{path} holds the progress of another job: {shown}; start the scheduler with the same "
            "settings, or another --state-dir"
        )
    return saved


def _parse(path: Path, payload: bytes) -> SavedProgress:
    """One copy's progress; DamagedFile if it is not a progress file or holds figures that cannot be."""
    try:
        data = json.loads(payload)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not a format-{FORMAT} progress file")
        evaluated, marks, speeds = data.pop("eval", None), data.pop("shard_marks", {}), data.pop("speeds", {})
        rollbacks = data.pop("rollbacks", [])
        saved = SavedProgress(
            **data,
            eval=EvalReport(**evaluated) if evaluated is not None else None,
            shard_marks={int(k): ShardMark(**v) for k, v in marks.items()},
            speeds={
                k: SavedSpeed(float(v["standalone_sps"]), [(int(b), float(s)) for b, s in v["observations"]])
                for k, v in speeds.items()
            },
            rollbacks=[Rollback(**r) for r in rollbacks],
        )
        saved.next_id = {str(k): int(v) for k, v in saved.next_id.items()}
        for name in ("samples", "lost_samples", "lost_versions", "train_size", "assignment_id", "local_steps"):
            if not isinstance(getattr(saved, name), int) or getattr(saved, name) < 0:
                raise ValueError(f"{name} is {getattr(saved, name)!r}, not a count")
        for name in (
            "saved_at",
            "saved_boot_s",
            "t",
            "training_s",
            "eval_time",
            "eval_model_time",
            "loss",
            "first_loss",
        ):
            value = getattr(saved, name)
            if not isinstance(value, (int, float, type(None))) or (value is not None and not math.isfinite(value)):
                raise ValueError(f"{name} is {value!r}, not a finite number")
        for name in ("t", "training_s", "eval_time", "eval_model_time"):
            if (getattr(saved, name) or 0.0) < 0:
                raise ValueError(f"{name} is {getattr(saved, name)!r}, a negative time")
        if not isinstance(saved.config, dict) or not isinstance(saved.saved_boot_id, str):
            raise ValueError("config is not a map of the job's settings")
        if not isinstance(saved.protocol, str):
            raise ValueError(f"protocol is {saved.protocol!r}, not a protocol's name")
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise DamagedFile(f"{path}: {exc}") from None
    return saved
