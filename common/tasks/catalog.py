"""The names of the datasets and models a job can choose.

Torch-free on purpose: the job's schema (common/config.py) validates these choices,
and `dynabatch keys` or a flag error must not wait seconds for torch to load. The
loaders (common/tasks/data.py) and builders (common/tasks/models.py) implement exactly these
names; tests/test_data.py and tests/test_models.py hold them to it.
"""

DATASETS = ("synthetic", "mnist", "fashion-mnist", "cifar10")
MODELS = ("mlp", "cnn", "resnet", "flat")
FLAT_PARAMS = 1_000_000  # the size of `flat` without one (`flat:N` has N parameters)
FLAT_MIN_PARAMS = 10  # one per class of the built-in datasets: its read-out needs them


def model_size(name: str) -> tuple[str, int]:
    """A model name as the architecture and, for `flat:N`, its parameter count (0 for the other models).

    The flat model is the transport benchmarks': its size is part of its name, so that the job's
    --model alone says which model every worker builds (and no size setting sits in every job's
    config for one benchmark model). ValueError naming what is wrong with a name that is no model.
    """
    base, sep, size = name.partition(":")
    if base not in MODELS:
        raise ValueError(f"{name!r} is not one of {', '.join(MODELS)} (or flat:N)")
    if base != "flat":
        if sep:
            raise ValueError(f"{name!r}: only the flat model takes a size (flat:N)")
        return base, 0
    if not sep:
        return base, FLAT_PARAMS
    if not size.isdigit() or int(size) < FLAT_MIN_PARAMS:
        raise ValueError(f"{name!r}: flat:N takes a whole number of parameters N >= {FLAT_MIN_PARAMS}")
    return base, int(size)


BUILTIN_METRICS = ("loss", "accuracy")  # what a built-in job's evaluations report (tests/test_task.py holds it)
