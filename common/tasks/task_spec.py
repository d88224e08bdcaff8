"""The syntax of `--task`: FILE.py:ATTR or package.module:ATTR, checked without importing anything.

Kept apart from common/tasks/task_check.py (which imports torch) so that a malformed spec is
refused at once, as a flag, before a command pays torch's import.
"""

from __future__ import annotations

from pathlib import Path

from dynabatch.task_error import TaskError


def names_a_file(where: str) -> bool:
    """`where` (a spec's part before the colon) is a file's path rather than a module's dotted name."""
    return where.endswith(".py") or "/" in where


def anchored_task_spec(spec: str) -> str:
    """`spec` with a file's path made absolute, so that it names the same file from any folder (a run folder
    records it for `dynabatch export`); a module's name, or a malformed spec, as it is."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr or not names_a_file(where):
        return spec
    return f"{Path(where).expanduser().resolve()}:{attr}"


def split_task_spec(spec: str) -> tuple[str, str]:
    """(where, attr) of `spec`; TaskError naming the expected forms if it is not one."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise TaskError(f"--task {spec!r}: expected FILE.py:ATTR or package.module:ATTR")
    return where, attr
