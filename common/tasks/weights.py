"""Weights from a file into a task's model: what `--init model.pt` does on every worker.

The file is a plain `state_dict` (`torch.save(model.state_dict(), path)`, which is
also what `dynabatch export` writes). It must fit the task's model key for key and
shape for shape: a file for another model is a TaskError naming the first key that
does not fit, found before the job starts rather than as a silent partial load.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from dynabatch.task_error import TaskError


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors saved in `path`; TaskError if it is missing, unreadable, or not a {name: tensor} dict.

    Loaded with `weights_only=True`: a weights file never runs code.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"--init: no file {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if isinstance(exc, pickle.UnpicklingError):  # torch's own words run to a dozen lines with terminal colours
            why = "it holds objects other than tensors, which torch's weights-only load refuses"
        else:
            why = f"{type(exc).__name__}: {exc}"
        raise TaskError(f"--init {path}: not a torch state_dict file ({why})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise TaskError(f"--init {path}: holds a {type(state).__name__}, not a state_dict ({{name: tensor}})")
    return state


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `model` (parameters, frozen ones included, and buffers) in place.

    TaskError naming the first key `source` lacks, has in excess, or holds at another shape.
    """
    own = model.state_dict()
    for key, tensor in own.items():
        if key not in state:
            raise TaskError(f"{source} has no {key} (the task's model has {key} {list(tensor.shape)})")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise TaskError(
                f"{source}: {key} is {list(state[key].shape)} there but {list(tensor.shape)} in the task's model"
            )
    extra = [key for key in state if key not in own]
    if extra:
        raise TaskError(
            f"{source} has {extra[0]}, which the task's model does not have"
            + (f" (and {len(extra) - 1} more such keys)" if len(extra) > 1 else "")
        )
    model.load_state_dict(state)
