"""Two shards train exactly like one: ssgd, same seed, same data order, to float tolerance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness import checkpoint_state, run_job

pytestmark = pytest.mark.slow

EPOCHS, BATCH, TRAIN = 0.6, 96, 12000  # 75 whole rounds: equality to float tolerance needs no more


def _train(tmp_path: Path, shards: int) -> tuple[torch.Tensor, list[int]]:
    run_dir, _ = run_job(
        tmp_path,
        f"s{shards}",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--protocol",
        "ssgd",
        "--batch-policy",
        "fixed",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--no-evaluator",
        "--epochs",
        str(EPOCHS),
        "--global-batch",
        str(BATCH),
        "--chunk-bytes",
        "131072",
        "--shards",
        str(shards),
    )
    samples = json.loads((run_dir / "summary.json").read_text())["samples"]
    assert samples == EPOCHS * TRAIN, f"{samples} samples: every round must be one global batch, the last one too"
    chunks: dict[int, torch.Tensor] = {}
    versions: list[int] = []
    for s in range(shards):
        saved = checkpoint_state(tmp_path / f"s{shards}" / "checkpoints" / f"shard-{s}.pt")
        chunks.update(saved["params"])
        versions += list(saved["chunk_versions"].values())
    return torch.cat([chunks[cid] for cid in sorted(chunks)]), versions


def test_two_shards_give_the_same_model_as_one(tmp_path: Path) -> None:
    one, v1 = _train(tmp_path, 1)
    two, v2 = _train(tmp_path, 2)
    rounds = math.ceil(EPOCHS * TRAIN / BATCH)
    assert set(v1) == {rounds} and set(v2) == {rounds}, "every chunk had exactly the job's rounds"
    assert len(v2) > 4, "the model must really be cut into chunks across both shards"
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
