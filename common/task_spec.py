"""The syntax of `--task`: FILE.py:ATTR or package.module:ATTR, checked without importing anything.

Kept apart from common/task.py (which imports torch) so that a malformed spec is
refused at once, as a flag, before a command pays torch's import.
"""

from __future__ import annotations

from dynabatch.common.task_error import TaskError


def split_task_spec(spec: str) -> tuple[str, str]:
    """(where, attr) of `spec`; TaskError naming the expected forms if it is not one."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise TaskError(f"--task {spec!r}: expected FILE.py:ATTR or package.module:ATTR")
    return where, attr
