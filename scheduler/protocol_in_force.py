"""Under `--protocol auto`: the protocol chosen, the one each shard reports applying, and the one workers step under.

The choice is auto's (scheduler/auto_policy.py: the protocol and the batch policy together, over the protocols
common/planning/protocol_switch.py allows). The shards are told the chosen protocol at once (ShardAssignment.
protocol) and switch their rule around the same model; the workers are told (WorkerAssignment.protocol) only once
every shard slot reports it in its heartbeat (`workers_protocol`), so that no worker pushes under a protocol a shard
does not apply yet. A worker's push that a switched shard refuses as made under the old protocol costs it that
step and no strike. Nothing a worker sends names a protocol the scheduler reads: only this part sets it.
"""

from __future__ import annotations

from dataclasses import replace

from dynabatch.common.planning.protocol_switch import SwitchPlan, switch_to, workers_protocol


class ProtocolInForce:
    """The protocol chosen for the shards, the one each shard slot reports, the workers' one and since when."""

    def __init__(self, plan: SwitchPlan, num_shards: int) -> None:
        self.plan = plan
        self.num_shards = num_shards
        self.chosen = plan.start
        self.workers = plan.start
        self.reported: dict[int, str] = {}  # by shard slot: the protocol it last reported applying
        self.since = 0  # the assignment the workers' protocol took effect from
        self.switches = 0  # how many times the workers' protocol changed

    def choose(self, choice: str) -> bool:
        """Auto chose protocol `choice`: the shards are told it from now on; True when it is a new one for them."""
        if switch_to(choice, self.chosen) is None or choice not in self.plan.protocols:
            return False
        self.chosen = choice
        return True

    def shard_report(self, shard: int, applied: str) -> bool:
        """Shard slot `shard` reports applying protocol `applied`; True when that settles the switch, the workers'
        protocol now being the chosen one."""
        self.reported[shard] = applied
        settled = workers_protocol(self.chosen, self.workers, self.reported, self.num_shards)
        if settled == self.workers:
            return False
        self.workers = settled
        self.switches += 1
        return True

    def refused(self, shard: int, refused: str) -> bool:
        """Shard slot `shard` reports it cannot run protocol `refused` (its task names the shards' optimizer, which a
        delta protocol would replace): auto chooses among the others from now on, and if it was the chosen one the
        shards go back to the workers' protocol. A shard says so as soon as it holds the model, before auto chooses
        it (ps/model_service.py `unrunnable`), or when ordered to switch. True when it was still among them."""
        if refused not in self.plan.protocols or switch_to(refused, self.workers) is None:
            return False
        note = f"{refused} left out: shard {shard} cannot run it (its log says why)"
        protocols = tuple(p for p in self.plan.protocols if switch_to(p, refused) is not None)
        self.plan = replace(
            self.plan, protocols=protocols, why_not="; ".join(n for n in (self.plan.why_not, note) if n)
        )
        if switch_to(refused, self.chosen) is None:
            self.chosen = self.workers
        return True

    def resume(self, saved: str) -> bool:
        """A restarted scheduler goes on under protocol `saved`, the one its saved job's workers stepped under (if
        it may choose it, else the start's); True when that is not the start's."""
        if switch_to(saved, self.workers) is None or saved not in self.plan.protocols:
            return False
        self.chosen = self.workers = saved
        self.switches += 1
        return True

    def forget_shard(self, shard: int) -> None:
        """A shard slot whose process left: its successor reports afresh."""
        self.reported.pop(shard, None)

    def reason(self, auto_reason: str) -> str:
        """Why the workers step under their protocol now, for STATUS: auto's reason, and where the switch stands."""
        if self.chosen != self.workers:
            applying = sum(1 for applied in self.reported.values() if switch_to(applied, self.chosen) is None)
            where = (
                f"switching from {self.workers} to {self.chosen}: {applying} of {self.num_shards} shards apply it; "
                "the workers follow once all do"
            )
        elif self.switches:
            where = f"{self.workers} since assignment {self.since}"
        else:
            where = f"{self.workers} from the start"
        notes = [where, auto_reason, self.plan.why_not]
        return "; ".join(n for n in notes if n)
