"""What a shard fixes when the scheduler welcomes it (ps/served_job.py): its job, index, series, checkpoint file,
push bounds, and the state it builds for a model, directly, without sockets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.wire.messages import Welcome
from dynabatch.common.wire.model_signature import signature_from_fields
from dynabatch.ps.checkpoint import ForeignCheckpoint
from dynabatch.ps.push_bounds import max_push_samples
from dynabatch.ps.served_job import ServedJob
from dynabatch.schedule import schedule_fields, step

SIG = signature_from_fields(["w", "b"], [[30, 10], [10]], ["float32", "float32"], train_size=500)


def _served(tmp_path: Path, index: int = 1, **job: Any) -> ServedJob:
    config = replace(JobConfig(), job="j", shards=2, chunk_bytes=1024, protocol="asgd", epochs=2.0, **job)
    return ServedJob.welcomed(
        Welcome(id="ps1", config=to_dict(config), shards=[], shard_index=index), CollectorRegistry(), str(tmp_path)
    )


def test_the_welcome_fixes_the_index_label_checkpoint_file_and_push_bounds(tmp_path: Path) -> None:
    served = _served(tmp_path, max_batch=64)
    assert (served.index, served.label, served.checkpoint_path) == (1, "1", tmp_path / "shard-1.pt")
    assert served.max_samples == max_push_samples(served.job) == 64
    assert served.checkpoint_meta == {"job": "j", "shard": 1, "shards": 2, "chunk_bytes": 1024}
    assert not ServedJob.welcomed(
        Welcome(id="ps0", config=to_dict(served.job), shards=[], shard_index=0), CollectorRegistry(), ""
    ).checkpoint_path  # no --checkpoint-dir: none kept


def test_the_state_it_builds_holds_this_shards_chunks_and_steps_with_the_inits_schedule(tmp_path: Path) -> None:
    served = _served(tmp_path)
    mine = served.chunks(SIG)
    assert mine and all(c.owner == 1 for c in mine)
    flat = torch.arange(SIG.total, dtype=torch.float32)
    state = served.new_state(SIG, flat, {}, schedule_fields(step([0.5], gamma=0.1)))
    assert [c.id for c in state.chunks] == [c.id for c in mine]
    assert torch.equal(state.params[mine[0].id], flat[mine[0].start : mine[0].stop])
    assert state.run_samples == SIG.train_size * 2.0  # the training set, twice: where the schedule's 0.5 falls
    state.follow_job(0.6, 1.0)
    assert state.lr_factor == pytest.approx(0.1)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in served.new_state(SIG, None, {}, {}).params.values())


def test_its_checkpoint_is_read_back_and_another_jobs_is_refused(tmp_path: Path) -> None:
    served = _served(tmp_path)
    assert served.load_checkpoint() is None  # none written yet
    served.save_checkpoint({"params": {}, "marker": 7})
    saved = served.load_checkpoint()
    assert saved is not None and saved["marker"] == 7
    other = ServedJob.welcomed(
        Welcome(id="ps1", config=to_dict(replace(served.job, job="other")), shards=[], shard_index=1),
        CollectorRegistry(),
        str(tmp_path),
    )
    with pytest.raises(ForeignCheckpoint):
        other.load_checkpoint()
