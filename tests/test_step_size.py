"""The shard's step size (ps/step_size.py) and how ShardState moves it: the schedule at the job's progress, the
job's factor after rollbacks, and the samples pushed between the scheduler's reports."""

from __future__ import annotations

import pytest
import torch

import dynabatch as db
from dynabatch import optim as optim_spec
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.ps.shard_state import ShardState
from dynabatch.ps.step_size import StepSize, async_weight, staleness_step

SGD = optim_spec.SGD(lr=0.1, momentum=0.0, weight_decay=0.0, nesterov=False)
B = 10


def test_the_factor_is_the_schedule_at_the_progress_times_the_jobs_factor() -> None:
    size = StepSize(db.schedule.warmup_cosine(warmup=0.5))
    assert size.factor == 0.0  # a warm-up starts at nothing
    size.advance(0.25)
    size.job_factor = 0.5
    assert size.factor == pytest.approx(0.5 * 0.5)


def test_progress_never_moves_back_and_stops_at_the_end() -> None:
    size = StepSize(db.schedule.step([0.5], gamma=0.1))
    size.advance(0.6)
    size.advance(0.2)  # a late or restarted report of the job's progress
    assert size.progress == 0.6 and size.factor == pytest.approx(0.1)
    size.advance(3.0)
    assert size.progress == 1.0


def _state(chunk_bytes: int = 1 << 20, run_samples: float = 100.0) -> ShardState:
    layout = make_layout(8, chunk_bytes, 1)
    warmup = StepSize(db.schedule.warmup_cosine(warmup=1.0 - 1e-9))  # a linear rise over the whole job
    state = ShardState.initial(layout.chunks, torch.zeros(8), SGD, "asgd", B, step_size=warmup, run_samples=run_samples)
    state.set_membership({"w0"}, allocated=1)
    return state


def _push(state: ShardState, samples: int, ids: list[int] | None = None) -> None:
    chunks = {c.id: torch.ones(c.length) for c in state.chunks if ids is None or c.id in ids}
    state.push("w0", chunks, {cid: state.chunk_versions[cid] for cid in chunks}, samples, state.kind, 0.0)


def test_samples_pushed_move_the_schedule_each_step_counted_once_and_the_scheduler_moves_it_further() -> None:
    state = _state(chunk_bytes=16)  # two chunks of 4
    assert len(state.chunks) == 2
    _push(state, 10)
    _push(state, 10, ids=[state.chunks[1].id])  # a pipelined step's later chunk: the same step, not counted again
    assert state.samples_seen == 10 and state.step_size.progress == pytest.approx(0.1)
    assert state.lr_factor == pytest.approx(0.1)  # the warm-up, linear over the whole job
    state.follow_job(0.5, 0.5)  # the scheduler counts every worker's samples; and one rollback halved the rate
    assert state.lr_factor == pytest.approx(0.25)
    _push(state, 10)
    assert state.step_size.progress == pytest.approx(0.5)  # 20 of 100 samples here: behind the scheduler's figure


def test_the_first_update_steps_at_the_schedules_value_not_at_full_rate() -> None:
    state = _state()
    _push(state, 10)  # progress 0 when it is applied: a warm-up's first step moves nothing
    assert torch.equal(state.params[state.chunks[0].id], torch.zeros(8))


def test_a_rollback_restores_the_model_and_samples_keeps_the_progress_and_refuses_pushes_on_thrown_away_versions() -> (
    None
):
    state = _state()
    _push(state, 10)
    saved = state.snapshot()
    saved["params"] = {cid: t.clone() for cid, t in saved["params"].items()}  # the snapshot holds them by reference
    _push(state, 10)
    _push(state, 10)
    cid = state.chunks[0].id
    assert (state.chunk_versions[cid], state.samples_seen) == (3, 30)
    state.roll_back(saved)
    assert (state.chunk_versions[cid], state.samples_seen) == (1, 10)
    assert state.step_size.progress == pytest.approx(0.3)  # the job's progress is the scheduler's: it moves on
    with pytest.raises(ProtocolError) as refused:
        state.check_base({cid: 3})  # computed on the version the rollback threw away
    assert refused.value.code == "rolled_back"
    state.check_base({cid: 1})  # the restored version is fine
    _push(state, 10)
    state.check_base({cid: 2})  # and so is a version reached again after the rollback


def test_the_delay_step_divides_by_the_staleness_and_the_constant_one_does_not() -> None:
    assert [staleness_step("delay", tau) for tau in (0, 1, 4, 63)] == [1.0, 1.0, 0.25, 1 / 63]
    assert [staleness_step("constant", tau) for tau in (0, 1, 63)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="staleness"):
        staleness_step("delay", -1)
    with pytest.raises(ValueError, match="constant or delay"):
        staleness_step("sqrt", 4)


def test_under_the_delay_step_a_gradient_takes_at_most_its_samples_over_delay_step_samples_of_lr() -> None:
    """The bound binds only where a small gradient is rarely stale: a gradient of at least 64 samples, or one stale
    enough, takes the delay step as before; the constant step has no bound."""
    assert async_weight("delay", 1.0, 1, 16, 64) == 0.25, "16 samples at staleness 1: a quarter of lr, not all of it"
    assert async_weight("delay", 1.0, 8, 16, 64) == 1 / 8, "stale enough: the delay step binds first"
    assert [async_weight("delay", 1.0, tau, 64, 64) for tau in (0, 1, 4)] == [1.0, 1.0, 0.25], "64 samples: unbound"
    assert async_weight("delay", 0.5, 1, 32, 256) == 0.125, "the batch weight, then the bound: min(0.5 / 1, 32 / 256)"
    assert async_weight("constant", 1.0, 1, 16, 64) == 1.0
    assert async_weight("constant", 0.25, 9, 16, 64) == 0.25
