"""The shard's own settings; the job's settings come from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.common.endpoint import check_endpoint
from dynabatch.common.flags import opt, validate_fields
from dynabatch.common.metrics import ON_FINISH


@dataclass
class PsOptions:
    scheduler: str = opt("tcp://127.0.0.1:5555", "scheduler control endpoint")
    job: str = opt("dynabatch", "job name to join")
    bind: str = opt("tcp://127.0.0.1:5600", "data endpoint to bind (port 0: any free port); loopback unless told "
                    "otherwise: tcp://0.0.0.0:5600 for workers on other machines")
    advertise: str = opt("", "endpoint workers connect to (default: the bound one, with this host's name)")
    shard_index: int = opt(-1, "this shard's index (-1: the scheduler assigns one)", minimum=-1)
    checkpoint_dir: str = opt("", "folder for checkpoints; resume from it on start (empty: none)")
    checkpoint_interval_s: float = opt(30.0, "seconds between checkpoints", minimum=0.1)
    name: str = opt("", "name in logs (default: ps-HOSTNAME)")
    threads: int = opt(1, "torch threads for applying updates (more only helps for very large chunks)", minimum=1)
    on_finish: str = opt("exit", "when the job ends: exit, or idle serving /healthz until stopped (Kubernetes)", ON_FINISH)

    def validate(self) -> None:
        validate_fields(self)
        check_endpoint("--bind", self.bind)
        check_endpoint("--scheduler", self.scheduler)
        if self.advertise:
            check_endpoint("--advertise", self.advertise)
