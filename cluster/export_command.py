"""`dynabatch export RUN_DIR --out model.pt`: a run's trained model as a plain PyTorch state_dict.

    model = make_model(); model.load_state_dict(torch.load("model.pt"))

The trainable parameters come from the run's shard checkpoints; frozen parameters
and buffers from the task's model built under the job's seed (or from the
checkpoints, where the shards keep buffers). See cluster/export.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import torch

from dynabatch.cluster.export import ExportError, trained_model
from dynabatch.cluster.options import ExportOptions
from dynabatch.common.dataset_files import DatasetNotFound
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args
from dynabatch.common.task_error import TaskError


def main(argv: Sequence[str]) -> int:
    parser = FlagParser("dynabatch export", __doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder written by dynabatch run")
    add_flags(parser, ExportOptions)
    args = parser.parse_args(argv)
    opts = from_args(ExportOptions, args)
    try:
        opts.validate()
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        model = trained_model(args.run_dir, opts.task)
    except (ExportError, TaskError, DatasetNotFound) as exc:
        print(f"dynabatch export: {exc}", file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    torch.save(state, out)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    print(f"wrote {out}: {len(state)} tensors ({trainable} trained parameters, "
          f"{len(state) - trainable} frozen parameters and buffers) from {args.run_dir}")
    return 0
