"""What the first INIT fixes for a job (ps/training_setup.py): read from an INIT or a checkpoint, and a later
worker's set-up compared with it, the first difference named."""

from __future__ import annotations

from typing import Any

import pytest

from dynabatch import optim as optim_spec
from dynabatch.common.wire.messages import Init
from dynabatch.common.wire.model_signature import ModelSignature, signature_fields, signature_from_fields
from dynabatch.ps.training_setup import TrainingSetup
from dynabatch.schedule import schedule_fields, warmup_cosine

SIG = signature_from_fields(["w"], [[4, 3]], ["float32"], train_size=100)
ADAM = optim_spec.Adam(lr=1e-3).to_wire()


def _init(
    sig: ModelSignature = SIG, optimizer: dict[str, Any] | None = None, schedule: dict[str, Any] | None = None
) -> Init:
    return Init(**signature_fields(sig), optimizer=optimizer or {}, schedule=schedule or {})


def test_an_init_and_a_checkpoint_give_the_same_setup() -> None:
    setup = TrainingSetup.from_init(_init(optimizer=ADAM, schedule=schedule_fields(warmup_cosine(0.1))))
    assert TrainingSetup.from_checkpoint({"other": 1, **setup.checkpoint_fields()}) == setup
    assert setup.difference(setup) is None


WARMUP = schedule_fields(warmup_cosine(0.2))


@pytest.mark.parametrize(
    "job, later, named",
    [
        (_init(), _init(signature_from_fields(["w"], [[4, 4]], ["float32"], train_size=100)), "w"),
        (
            _init(optimizer=ADAM),
            _init(optimizer=optim_spec.Adam(lr=1e-2).to_wire()),
            "optimizer: lr 0.001 (job) != 0.01 (this worker)",
        ),
        (
            _init(optimizer=ADAM),
            _init(optimizer=ADAM, schedule=WARMUP),
            "schedule: this worker's task names warmup_cosine, the job's none",
        ),
        (
            _init(schedule=WARMUP),
            _init(schedule=schedule_fields(warmup_cosine(0.1))),
            "schedule: warmup 0.2 (job) != 0.1 (this worker)",
        ),
    ],
)
def test_a_later_workers_setup_that_differs_is_refused_naming_the_difference(
    job: Init, later: Init, named: str
) -> None:
    found = TrainingSetup.from_init(job).difference(TrainingSetup.from_init(later))
    assert found is not None and named in found, found


def test_a_malformed_schedule_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not one of"):
        TrainingSetup.from_init(_init(schedule={"name": "sawtooth"}))
