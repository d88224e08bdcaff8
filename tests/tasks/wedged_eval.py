"""The blobs task (blobs.py) whose evaluation set hangs for ever on its second pass, in every process.

An evaluator on it reports one real evaluation, then its main thread blocks in the
data, as one whose test set sits on a filesystem that hung, while its heartbeat
thread beats on: the scheduler must drop it for making no progress, and the job's
end must not wait for it. Deterministic: the count is of this process's own reads.
"""

import threading
from dataclasses import replace

import blobs
import torch

HANG_AFTER = 1.5  # passes over the set: the first evaluation is whole, the second hangs midway


class HangsOnSecondPass(blobs.Blobs):
    def __init__(self) -> None:
        super().__init__(1000, seed=2)
        self.reads = 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        if self.reads > HANG_AFTER * len(self):
            threading.Event().wait()  # for ever
        return super().__getitem__(i)


task = replace(blobs.task, eval_data=HangsOnSecondPass)
