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

The file is written next to its name, flushed to disk and renamed over it, so a
crash leaves the old state or the new one. A file that does not parse, or was
written for another job or another configuration, is an error: never a silent
start from zero.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynabatch.common.messages import EvalReport, Rollback
from dynabatch.scheduler.lost_work import ShardMark

FORMAT = 1


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
    final_eval: bool = False
    budget_spent: bool = False
    shard_marks: dict[int, ShardMark] = field(default_factory=dict)
    speeds: dict[str, SavedSpeed] = field(default_factory=dict)
    rollbacks: list[Rollback] = field(default_factory=list)


def progress_path(state_dir: str, job: str) -> Path:
    return Path(state_dir) / f"scheduler-{job}.json"


def save_progress(path: Path, progress: SavedProgress) -> None:
    """Write `progress` to `path` atomically (tmp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **asdict(progress)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_progress(path: Path, config: dict[str, Any]) -> SavedProgress | None:
    """The progress saved at `path` for the job `config` describes; None if there is no file.

    Raises ValueError naming the file and what is wrong with it: unreadable,
    another format, or another job (the settings that differ).
    """
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not a format-{FORMAT} progress file")
        saved = SavedProgress(**data)
        saved.eval = EvalReport(**saved.eval) if saved.eval is not None else None
        saved.shard_marks = {int(k): ShardMark(**v) for k, v in saved.shard_marks.items()}
        saved.speeds = {k: SavedSpeed(float(v["standalone_sps"]), [(int(b), float(s)) for b, s in v["observations"]])
                        for k, v in saved.speeds.items()}
        saved.next_id = {str(k): int(v) for k, v in saved.next_id.items()}
        saved.rollbacks = [Rollback(**r) for r in saved.rollbacks]
        for name in ("samples", "lost_samples", "lost_versions", "train_size", "assignment_id", "local_steps"):
            if not isinstance(getattr(saved, name), int) or getattr(saved, name) < 0:
                raise ValueError(f"{name} is {getattr(saved, name)!r}, not a count")
        for name in ("saved_at", "t", "training_s", "eval_time", "loss", "first_loss"):
            if not isinstance(getattr(saved, name), (int, float, type(None))):
                raise ValueError(f"{name} is {getattr(saved, name)!r}, not a number")
        if not isinstance(saved.config, dict):
            raise ValueError("config is not a map of the job's settings")
    except (OSError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ValueError(f"{path}: the scheduler's saved progress cannot be read ({exc}); remove it to start "
                         "the job from zero") from None
    expected = json.loads(json.dumps(config))
    differ = sorted(k for k in expected.keys() | saved.config.keys() if expected.get(k) != saved.config.get(k))
    if differ:
        shown = ", ".join(f"{k}={saved.config.get(k)!r} (now {expected.get(k)!r})" for k in differ[:5])
        raise ValueError(f"{path} holds the progress of another job: {shown}; start the scheduler with the same "
                         "settings, or another --state-dir")
    return saved
