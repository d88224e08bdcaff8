"""`--protocol auto` without a cluster file: the protocol chosen at run time from what the scheduler measures.

The regime study (bench/RESULTS.md section 17) found the winner is a protocol choice (an asynchronous protocol on
mixed GPUs and links, local SGD where a shard bounds the job), which the shards and workers must follow while the job
runs. So a job under auto starts on `START` (asgd: the measuring protocol, every worker steps at its own pace, as
auto's batch policy starts fixed) and the scheduler chooses the protocol and the batch policy together once every
ready worker is measured (scheduler/auto_policy.py), among `SWITCHABLE` that the job's flags allow (`switch_plan`).

The switch, told in the scheduler's assignments (`protocol`): the shards first (each rebuilds its rule around the
same model, versions and trust state: ps/shard_state.py `switch`), then, once every shard reports the new protocol
in its heartbeat, the workers, each at its next step boundary (`workers_protocol`). A push made under the old
protocol that reaches a switched shard is refused `switched`, which is no strike; a worker never sets the protocol.

One learning rate for every protocol: asgd runs with the delay step (lr / max(1, tau), `--staleness-step delay`),
so that one `--lr` is about the same step per B samples under each (the study's tuned steps: asgd 0.02 with a
constant step but 0.4 with the delay step, ssgd 0.4, local 0.32).

This module is pure (no sockets): the scheduler, the shards, the workers and the simulator (bench/simulate.py)
call the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dynabatch.common.flags import ConfigError

if TYPE_CHECKING:
    from dynabatch.common.config import JobConfig

AUTO = "auto"
START = "asgd"
SWITCHABLE: tuple[str, ...] = ("asgd", "ssgd", "local")
"""The protocols auto switches among: those whose shard rule can take over a model another left (the chunk
optimizers of a gradient protocol, the outer optimizer of local SGD, fresh on the switch) and whose worker loop
starts from a pull. Not Ringmaster, which the predictor also models: under auto it would run the delay step, which
already shrinks a stale gradient's step, so its threshold only throws the slowest workers' samples away; asgd at the
delay step was never slower than it on the clusters measured, while the predictor ranks it ahead of asgd
(bench/RESULTS.md 35 and 38). `--protocol ringmaster` runs it."""


def switches(job: JobConfig) -> bool:
    """Whether `job` chooses its protocol at run time (`--protocol auto` without `--cluster-profile`)."""
    return job.protocol == AUTO and not job.cluster_profile


def running(job: JobConfig, protocol: str) -> JobConfig:
    """`job` as run under `protocol` by auto: that protocol, the asynchronous ones with the delay step."""
    return replace(job, protocol=protocol, staleness_step="delay")


@dataclass(frozen=True)
class SwitchPlan:
    """The protocol auto starts on, those it may switch to (the start among them), and why others are not."""

    start: str
    protocols: tuple[str, ...]
    why_not: str = ""


def switch_plan(job: JobConfig) -> SwitchPlan:
    """What auto may do with `job`: each of SWITCHABLE that the job's flags allow (`running(job, p).validate()`),
    starting on START where it is allowed. A robust `--aggregation` keeps the protocol it starts on: it defends
    every round by the honest majority of every worker's gradient, which a protocol without rounds has not.
    ConfigError when no switchable protocol takes the job's flags."""
    allowed, refused = [], []
    for protocol in SWITCHABLE:
        try:
            running(job, protocol).validate()
        except ConfigError as exc:
            refused.append(f"{protocol} ({exc})")
        else:
            allowed.append(protocol)
    if not allowed:
        raise ConfigError(f"--protocol {AUTO}: no protocol it chooses among takes this job: {'; '.join(refused)}")
    start = START if START in allowed else allowed[0]
    if job.aggregation != "mean":
        return SwitchPlan(
            start,
            (start,),
            f"--aggregation {job.aggregation} defends each round by every worker's gradient: auto keeps {start}",
        )
    return SwitchPlan(start, tuple(allowed), "; ".join(refused))


def switch_to(named: str, current: str) -> str | None:
    """The protocol an assignment (or a push) names if it is another than `current` ("" names none): the one rule
    by which a role tells a switch, so that no role compares protocols itself."""
    return named if named and named != current else None


def workers_protocol(chosen: str, in_force: str, shards: Mapping[int, str], num_shards: int) -> str:
    """The protocol workers are told: the `chosen` one once every one of the `num_shards` shard slots reports it
    (`shards`: each slot's reported protocol), else the one they step under now (`in_force`)."""
    if chosen == in_force:
        return in_force
    settled = len(shards) >= num_shards and all(shards.get(s) == chosen for s in range(num_shards))
    return chosen if settled else in_force
