"""`--loader-workers K`: a real DataLoader with K processes, its batch sampler following the assigned size."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from dynabatch.common.tasks.data import SampleOrder
from dynabatch.worker.loader_batches import LoaderBatches

N = 5000


class Numbers(torch.utils.data.Dataset[int]):
    """Sample i is the number i: a batch shows which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _pending(source: LoaderBatches) -> list[int]:
    """Samples drawn from the order but not delivered yet: handed back, or loading ahead."""
    return list(source.sampler.returned) + [i for indices in source.sampler.issued for i in indices]


def _drawn(count: int) -> list[int]:
    return SampleOrder(N, seed=3).take(count).tolist()


def test_two_loader_workers_follow_a_batch_size_change_without_losing_or_repeating_samples() -> None:
    source = LoaderBatches(Numbers(), SampleOrder(N, seed=3), default_collate, workers=2, seed=0)
    try:
        asked = [32, 32, 32, 48, 48, 48, 48, 48, 48, 16, 16, 16, 16, 16, 16, 32]
        seen: list[int] = []
        for size in asked:
            batch = source.take(size)
            source.step_succeeded()
            assert len(batch) == size, "every batch has exactly the size asked for"
            seen += batch.tolist()
        assert source.discarded > 0, "batches prefetched at the old size were loaded and not handed out"
        assert len(seen) == len(set(seen)) == sum(asked), "no sample twice"
        pending = _pending(source)
        assert sorted(seen + pending) == sorted(_drawn(len(seen) + len(pending))), "no sample lost"
        assert seen[:96] == _drawn(96), "the worker's own order"
    finally:
        source.close()


def test_a_failed_step_gets_the_same_batch_again_or_its_samples_go_back_to_the_sampler() -> None:
    source = LoaderBatches(Numbers(), SampleOrder(N, seed=3), default_collate, workers=2, seed=0)
    try:
        first = source.take(20)
        source.step_failed()
        assert torch.equal(source.take(20), first), "a retry of the same size trains on the same samples"
        source.step_failed()
        seen = []
        for _ in range(12):  # the assignment changed meanwhile: the failed samples come back within a few batches
            seen += source.take(30).tolist()
            source.step_succeeded()
        assert set(first.tolist()) <= set(seen) and len(seen) == len(set(seen))
        pending = _pending(source)
        assert sorted(seen + pending) == sorted(_drawn(len(seen) + len(pending)))
    finally:
        source.close()
