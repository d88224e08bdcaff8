"""The shard's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.flags import opt
from dynabatch.common.net.endpoint import check_endpoint
from dynabatch.common.shared_options import MemberOptions, ShardCheckpointOptions


@dataclass
class PsOptions(MemberOptions, ShardCheckpointOptions):
    """A shard's own settings; how it joins its job and how often it checkpoints are shared
    (common/shared_options.py)."""

    bind: str = opt(
        "tcp://127.0.0.1:5600",
        "data endpoint to bind (port 0: any free port); loopback unless told "
        "otherwise: tcp://0.0.0.0:5600 for workers on other machines",
        topic="cluster",
    )
    advertise: str = opt(
        "", "endpoint workers connect to (default: the bound one, with this host's name)", topic="cluster"
    )
    shard_index: int = opt(-1, "this shard's index (-1: the scheduler assigns one)", minimum=-1, topic="cluster")
    checkpoint_dir: str = opt("", "folder for checkpoints; resume from it on start (empty: none)", topic="cluster")
    threads: int = opt(
        1, "torch threads for applying updates (more only helps for very large chunks)", minimum=1, topic="cluster"
    )

    def validate(self) -> None:
        MemberOptions.validate(self)
        check_endpoint("--bind", self.bind)
        if self.advertise:
            check_endpoint("--advertise", self.advertise)
