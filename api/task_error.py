"""The error of a task that cannot be trained, apart from the Task API itself.

It lives in a module of its own, without torch, so that a process that only
reports task errors (`dynabatch run` checking a built-in job) need not import torch.
"""

from __future__ import annotations

__all__ = ["TaskError"]


class TaskError(ValueError):
    """A task that cannot be trained, with what to fix."""
