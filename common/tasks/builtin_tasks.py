"""The built-in models and datasets as Tasks, written with the same API a user's task uses.

`--model cnn --dataset fashion-mnist` is shorthand for `builtin_task("fashion-mnist",
"cnn")`. The image sets keep the whole split in memory as uint8 and build a
batch with tensor operations (`__getitems__`, which torch's DataLoader uses
too), so feeding a worker stays far cheaper than its forward pass.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset as TorchDataset

from dynabatch.common.config import JobConfig
from dynabatch.common.tasks.data import NUM_CLASSES, Dataset, input_shape, load_dataset, make_batch
from dynabatch.common.tasks.models import build_model
from dynabatch.common.tasks.task_check import check_task
from dynabatch.common.wire.chunking import flat_params
from dynabatch.common.wire.messages import Init
from dynabatch.common.wire.model_signature import signature_fields
from dynabatch.task import Task

AUGMENT_SEED = 17


class ImageSet(TorchDataset[tuple[torch.Tensor, torch.Tensor]]):
    """One split of a built-in image dataset as a map-style Dataset of (image, label) pairs."""

    def __init__(self, data: Dataset, train: bool) -> None:
        self.data, self.train = data, train
        self.generator = torch.Generator().manual_seed(AUGMENT_SEED)

    def __len__(self) -> int:
        return len(self.data.train_y if self.train else self.data.test_y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Many samples in one tensor operation (normalised; training images augmented where the set is)."""
        x, y = make_batch(self.data, torch.as_tensor(indices, dtype=torch.int64), self.train, self.generator)
        return list(zip(x.unbind(0), y.unbind(0), strict=True))


def builtin_task(dataset: str, model: str, data_dir: str | None = None) -> Task:
    """The task behind `--dataset DATASET --model MODEL`; the data is read once, on first use."""
    shape = input_shape(dataset)
    loaded: dict[str, Dataset] = {}

    def data() -> Dataset:
        if "all" not in loaded:
            loaded["all"] = load_dataset(dataset, data_dir)
        return loaded["all"]

    def make_model() -> torch.nn.Module:
        # Task.build_model has seeded torch's generator with the job's seed; build_model reseeds with the same
        # seed, so a built-in model's initial parameters are what they always were for that seed.
        return build_model(model, shape, NUM_CLASSES, seed=torch.initial_seed())

    return Task(
        model=make_model,
        train_data=lambda: ImageSet(data(), True),
        eval_data=lambda: ImageSet(data(), False),
        name=f"{model} on {dataset}",
    )


def builtin_init(job: JobConfig, data_dir: str | None = None) -> tuple[Init, torch.Tensor]:
    """The INIT a worker of a built-in job sends, and its initial flat parameters.

    For clients that talk to shards without a worker around them (benchmarks, tests).
    """
    task = builtin_task(job.dataset, job.model, data_dir)
    sig = check_task(task, job.seed).signature
    return Init(**signature_fields(sig)), flat_params(task.build_model(job.seed))
