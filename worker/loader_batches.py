"""Batches loaded ahead by a torch DataLoader (`--loader-workers K`), each of exactly the assigned size.

dynabatch owns the sampler. `AssignedBatchSampler` is the DataLoader's batch
sampler: an endless stream of index lists drawn from the worker's own order
(`SampleOrder`), each of the size the worker last asked for. The DataLoader's K
processes load and collate up to `prefetch_factor * K` batches ahead, so when
the scheduler changes the worker's batch, some batches are already loaded at
the old size. They are not trained on: their indices go back to the sampler,
which hands them out first in the next lists it makes. So every batch a step
gets has exactly the size it asked for (the shards weight it by that size and
the scheduler counts that many samples), no sample is lost or repeated, and a
change costs the loading of at most the prefetched batches (time the worker
reports as its `data` phase). With K = 0 batches are fetched in the worker's
own process instead (batch_source.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from dynabatch.common.tasks.data import SampleOrder


class AssignedBatchSampler:
    """Index lists of the currently wanted `size`: indices handed back first, then the worker's order.

    The DataLoader asks for the next list whenever it has room to load one more
    batch, in this process; `issued` keeps the lists it took, oldest first, which
    is the order it delivers their batches in.
    """

    def __init__(self, order: SampleOrder, size: int) -> None:
        self.order = order
        self.size = size
        self.returned: deque[int] = deque()
        self.issued: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def next_indices(self) -> list[int]:
        """The next list of `size` indices; noted in `issued`."""
        indices = [self.returned.popleft() for _ in range(min(self.size, len(self.returned)))]
        if len(indices) < self.size:
            indices += self.order.take(self.size - len(indices)).tolist()
        self.issued.append(indices)
        return indices

    def give_back(self, indices: list[int]) -> None:
        """Samples that were loaded but not trained on: they go out again before any new one."""
        self.returned.extend(indices)


class LoaderBatches:
    """Collated batches from a DataLoader of `workers` processes, replaying a failed step's batches.

    After a failed step, a retry that asks for the same size gets the very same
    batches again; one that asks for another size gets fresh ones, and the
    failed step's samples go back to the sampler.
    """

    def __init__(
        self, dataset: Any, order: SampleOrder, collate: Callable[[list[Any]], Any], workers: int, seed: int
    ) -> None:
        if workers < 1:
            raise ValueError(f"a DataLoader needs at least one worker process, got {workers}")
        self.sampler = AssignedBatchSampler(order, 1)
        self.loader = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(seed),
        )
        self._batches: Iterator[Any] | None = None
        self.replay: list[tuple[list[int], Any]] = []
        self.taken: list[tuple[list[int], Any]] = []
        self.discarded = 0

    def take(self, batch: int) -> Any:
        """The next collated batch of exactly `batch` samples (a failed step's, if it had that size)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if self.replay and len(self.replay[0][0]) == batch:
            item = self.replay.pop(0)
        else:
            for indices, _ in self.replay:
                self.sampler.give_back(indices)
            self.replay = []
            item = self._load(batch)
        self.taken.append(item)
        return item[1]

    def _load(self, batch: int) -> tuple[list[int], Any]:
        self.sampler.size = batch
        if self._batches is None:
            self._batches = iter(self.loader)  # starts the processes, which load ahead at this size
        while True:
            loaded = next(self._batches)
            indices = self.sampler.issued.popleft()
            if len(indices) == batch:
                return indices, loaded
            self.sampler.give_back(indices)  # prefetched at a size no longer wanted
            self.discarded += 1

    def step_succeeded(self) -> None:
        """The batches taken since the last step were trained on: never hand them out again."""
        self.taken = []

    def step_failed(self) -> None:
        """The batches taken since the last step were not trained on: hand them out again next."""
        self.replay, self.taken = self.taken, []

    def close(self) -> None:
        """Stop the loading processes."""
        self._batches = None
