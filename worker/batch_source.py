"""Which samples a worker trains on next, replaying a failed step's samples.

Each worker draws from its own shuffled order of the whole training set
(`SampleOrder`). A step that fails (a shard timed out, a push was refused) is
retried on the same samples, so what a worker trains on does not depend on when
a shard or the scheduler hiccuped, and no sample is skipped for it.
"""

from __future__ import annotations

import torch

from dynabatch.common.data import SampleOrder


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
