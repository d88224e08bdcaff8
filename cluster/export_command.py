"""`dynabatch export RUN_DIR --out model.pt`: a run's trained model as a plain PyTorch state_dict.

    model = make_model(); model.load_state_dict(torch.load("model.pt"))

The trainable parameters come from the run's shard checkpoints; frozen parameters
and buffers from the task's model built under the job's seed (or from the
checkpoints, where the shards keep buffers). See cluster/export.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dynabatch.cluster.options import ExportOptions
from dynabatch.common.atomic_file import write_atomic
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.common.tasks.dataset_files import BadDatasetFile, DatasetNotFound
from dynabatch.task_error import TaskError


def main(argv: Sequence[str]) -> int:
    parser = FlagParser("dynabatch export", __doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder written by dynabatch run")
    add_flags(parser, ExportOptions)
    args = parser.parse_args(argv)
    opts = from_args(ExportOptions, args)
    out = Path(opts.out)
    try:
        opts.validate()
        if out.is_dir():
            raise ConfigError(f"--out {out} is a folder: name the file to write, e.g. --out {out / 'model.pt'}")
    except ConfigError as exc:
        parser.error(str(exc))
    # torch's import (seconds of CPU) only once the flags are known good: --help and a flag's error are instant
    import torch

    from dynabatch.cluster.export import ExportError, trained_model

    try:
        model = trained_model(args.run_dir, opts.task)
    except (ExportError, TaskError, DatasetNotFound, BadDatasetFile) as exc:
        print(f"dynabatch export: {exc}", file=sys.stderr)
        return 2
    state = model.state_dict()
    try:
        write_atomic(out, lambda f: torch.save(state, f))
    except OSError as exc:
        print(f"dynabatch export: --out {out}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
        return 2
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    print(
        f"wrote {out}: {len(state)} tensors ({trainable} trained parameters, "
        f"{len(state) - trainable} frozen parameters and buffers) from {args.run_dir}"
    )
    unfinished = _unfinished(args.run_dir)
    if unfinished:
        print(f"dynabatch export: note: {unfinished}", file=sys.stderr)
    return 0


def _unfinished(run_dir: Path) -> str:
    """Why the run in `run_dir` did not finish, as its summary.json says ("" where it finished, or says nothing): its
    model is then as its shards last checkpointed it, which a failed start leaves untrained."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(summary, dict) or summary.get("finished", True):
        return ""
    why = summary.get("failed") or ("interrupted" if summary.get("interrupted") else "its logs say why")
    trained = summary.get("epochs_trained")
    epochs = f"{trained:.3g} epochs" if isinstance(trained, (int, float)) else "an unknown part of its epochs"
    return f"the run did not finish ({why}); this is its model as the shards last checkpointed it, after {epochs}"
