"""A shard started on a checkpoint of another job refuses it in one line and exits 2.

On Kubernetes that is a claim left over from an earlier job: the shard must neither
load the other job's model nor overwrite it, and the pod's log must say what to do,
not end in a traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynabatch.ps.checkpoint import save_checkpoint
from hang_guard import hang_guard_s
from harness import Cluster


def test_a_shard_refuses_another_jobs_checkpoint_with_one_line(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    theirs = {"job": "last-weeks-job", "shard": 0, "shards": 1, "chunk_bytes": 1 << 20}
    save_checkpoint(ckpt_dir / "shard-0.pt", theirs, {"params": {0: torch.ones(4)}})
    before = (ckpt_dir / "shard-0.pt").read_bytes()
    c = Cluster(tmp_path, ["--dataset", "synthetic", "--model", "mlp", "--job", "dynabatch"])
    try:
        c.scheduler()
        shard = c.shard(0, None, "--checkpoint-dir", str(ckpt_dir))
        assert shard.proc.wait(hang_guard_s(120)) == 2, shard.log_text()
        log = shard.log_text()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1, log
        assert "checkpoint of another job" in errors[0] and "'last-weeks-job' there, 'dynabatch' here" in errors[0]
        assert "delete it" in errors[0]
        assert (ckpt_dir / "shard-0.pt").read_bytes() == before, "another job's checkpoint is never overwritten"
    finally:
        c.stop()
