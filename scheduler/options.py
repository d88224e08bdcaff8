"""The scheduler's own settings; it also owns the whole JobConfig."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.flags import opt, validate_fields


@dataclass
class SchedulerOptions:
    bind: str = opt("tcp://127.0.0.1:5555", "control endpoint to bind; loopback unless told otherwise: "
                    "tcp://0.0.0.0:5555 for processes on other machines")
    state_dir: str = opt("", "folder for the job's progress (scheduler-JOB.json), saved every second and at each "
                         "evaluation; a restarted scheduler resumes the job from it (empty: none)")
    exit_on_finish: bool = opt(True, "exit once the job has finished and its shards are told (off: serve STATUS until stopped)")

    def validate(self) -> None:
        validate_fields(self)
