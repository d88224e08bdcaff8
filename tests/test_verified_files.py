"""common/verified_files.py and the shard's checkpoints on it: a damaged copy is refused, the previous one read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dynabatch.common.atomic_file import previous_path
from dynabatch.common.verified_files import DamagedFile, load_newest_good, read_verified, write_verified
from dynabatch.ps.checkpoint import ForeignCheckpoint, load_checkpoint, save_checkpoint

META = {"job": "j", "shard": 0, "shards": 1, "chunk_bytes": 64}


def _read(path: Path) -> tuple[bytes | None, list[str]]:
    warnings: list[str] = []
    return load_newest_good(path, lambda _copy, payload: payload, warnings.append), warnings


def test_a_written_file_reads_back_and_the_one_it_replaced_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert _read(path) == (None, [])
    write_verified(path, b"one")
    write_verified(path, b"two")
    assert read_verified(path) == b"two" and read_verified(previous_path(path)) == b"one"
    assert not list(tmp_path.glob(".*tmp")), "no temporary file is left behind"


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[:-3], lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b"junk"],
    ids=["truncated", "a flipped bit", "not ours"],
)
def test_a_damaged_copy_is_refused_with_one_line_and_the_previous_one_is_read(
    tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    path = tmp_path / "f"
    write_verified(path, b"good payload")
    write_verified(path, b"newer payload")
    path.write_bytes(damage(path.read_bytes()))
    payload, warnings = _read(path)
    assert payload == b"good payload" and len(warnings) == 1 and str(path) in warnings[0]
    previous_path(path).write_bytes(b"")
    with pytest.raises(DamagedFile):
        _read(path)


def _state(value: float) -> dict[str, Any]:
    return {
        "params": {0: torch.full((4,), value)},
        "optimizer_state": {0: {"buf": torch.zeros(4)}},
        "chunk_versions": {0: int(value)},
    }


def test_a_checkpoint_with_a_non_finite_value_is_refused_and_the_previous_one_resumed(tmp_path: Path) -> None:
    path = tmp_path / "shard-0.pt"
    save_checkpoint(path, META, _state(1.0))
    bad = _state(2.0)
    bad["optimizer_state"][0]["buf"][1] = float("nan")
    save_checkpoint(path, META, bad)
    resumed = load_checkpoint(path, META)
    assert resumed is not None and resumed["chunk_versions"] == {0: 1}


def test_no_good_checkpoint_starts_the_shard_without_one_and_another_jobs_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "shard-0.pt"
    save_checkpoint(path, META, _state(1.0))
    with pytest.raises(ForeignCheckpoint, match="is a checkpoint of another job"):
        load_checkpoint(path, {**META, "job": "other"})
    path.write_bytes(path.read_bytes()[:100])
    assert load_checkpoint(path, META) is None
