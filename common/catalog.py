"""The names of the datasets and models a job can choose.

Torch-free on purpose: the job's schema (common/config.py) validates these choices,
and `dynabatch keys` or a flag error must not wait seconds for torch to load. The
loaders (common/data.py) and builders (common/models.py) implement exactly these
names; tests/test_data.py and tests/test_models.py hold them to it.
"""

DATASETS = ("synthetic", "mnist", "fashion-mnist", "cifar10")
MODELS = ("mlp", "cnn", "resnet", "flat")
BUILTIN_METRICS = ("loss", "accuracy")  # what a built-in job's evaluations report (tests/test_task.py holds it)
