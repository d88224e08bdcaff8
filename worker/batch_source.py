"""Which samples a worker trains on next, replaying a failed step's samples.

Each worker draws from its own shuffled order of the whole training set
(`SampleOrder`). A step that fails (a shard timed out, a push was refused) is
retried on the same samples, so what a worker trains on does not depend on when
a shard or the scheduler hiccuped, and no sample is skipped for it.

`DatasetBatches` fetches and collates each batch in the worker's own process
when a step asks for it (`--loader-workers 0`, the default); loader_batches.py
loads them ahead in other processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dynabatch.common.tasks.data import SampleOrder


def worker_order(train_size: int, job_seed: int, number: int) -> SampleOrder:
    """The own shuffled order of the training set of the job's `number`-th worker (`Welcome.number`): seeded by
    the job and the worker, so a worker's samples are the same in every run of a job (and in the simulator,
    bench/simulate.py)."""
    return SampleOrder(train_size, seed=job_seed * 7919 + number)


class BatchSource:
    """The next batches' sample indices, with the current step's kept until it succeeds or fails."""

    def __init__(self, order: SampleOrder) -> None:
        self.order = order
        self.replay: list[torch.Tensor] = []
        self.taken: list[torch.Tensor] = []

    def take(self, batch: int) -> torch.Tensor:
        """Indices of the next `batch` samples: a failed step's, in order, if it had the same size."""
        if self.replay and len(self.replay[0]) == batch:
            indices = self.replay.pop(0)
        else:
            self.replay, indices = [], self.order.take(batch)
        self.taken.append(indices)
        return indices

    def step_succeeded(self) -> None:
        """The samples taken since the last step were trained on: never replay them."""
        self.taken = []

    def step_failed(self) -> None:
        """The samples taken since the last step were not trained on: hand them out again next."""
        self.replay, self.taken = self.taken, []


class DatasetBatches:
    """Collated batches of the samples `BatchSource` names, fetched in this process on demand."""

    def __init__(self, dataset: Any, order: SampleOrder, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate
        self.source = BatchSource(order)

    def take(self, batch: int) -> Any:
        """The next `batch` samples, collated (a failed step's again, if it had that size)."""
        return fetch(self.dataset, self.source.take(batch), self.collate)

    def step_succeeded(self) -> None:
        self.source.step_succeeded()

    def step_failed(self) -> None:
        self.source.step_failed()

    def close(self) -> None:
        """Nothing runs beside this process."""


def fetch(dataset: Any, indices: torch.Tensor, collate: Callable[[list[Any]], Any]) -> Any:
    """The batch of `indices`: through the dataset's `__getitems__` when it has one (as torch's
    DataLoader does), else item by item, then collated."""
    wanted = indices.tolist()
    getitems = getattr(dataset, "__getitems__", None)
    return collate(getitems(wanted) if getitems is not None else [dataset[i] for i in wanted])


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a batch (a tensor, or tuples, lists and dicts of them) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_len(batch: Any) -> int:
    """How many samples a batch holds: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        if isinstance(value, (torch.Tensor, dict, list, tuple)):
            return batch_len(value)
    raise ValueError("a batch holds no tensor")
