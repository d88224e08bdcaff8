"""What a registered, authenticated worker can send that no receiver can refuse on its form: Byzantine gradients,
and its own accepted PUSHes again.

Pure: `ByzantineMember` is the fuzzer's own worker, admitted to the job with a
batch (so that every ssgd round waits for its push, as for an honest worker's),
bound to its own connection to every shard. `push` builds one of its lies from
`gradient`, the job's true descent direction as the fuzzer measured it (the
model's movement between two pulls, per step), so that a sign flip points
against what the honest workers push. Each lie is well-formed: the right chunks,
shapes and versions, from the right connection. What each must get
(`MUST_REFUSE`, `FAR`) is what fuzz/run.py judges: the shards refuse it, or take
it bounded (clipped to the gradient bound, ps/gradient_bounds.py) and count it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from dynabatch.common.wire.frames import ChunkMeta
from dynabatch.common.wire.messages import Push

GRADIENTS = ("scaled_1e3", "scaled_1e6", "flipped", "noise", "non_finite", "over_claimed", "one_sample")
REPLAYS = ("replay_own", "replay_other")
# Taken only clipped: their norm is at least 1e3 times the true gradient's, far beyond the bound (4x typical).
FAR = frozenset({"scaled_1e3", "scaled_1e6", "noise"})
# Never taken, and refused for what they are. A replay from another connection meets the shard's sender binding
# (ps/senders.py) while the member is live, and the member's absence once it is not; the replay guard, keyed by
# connection, answers only the replay on the member's own.
MUST_REFUSE: dict[str, frozenset[str]] = {
    "non_finite": frozenset({"non_finite"}),
    "over_claimed": frozenset({"bad_field"}),
    "replay_own": frozenset({"replay"}),
    "replay_other": frozenset({"bad_sender", "unknown_sender", "quarantined"}),
}
# What any of its pushes may get besides: ssgd takes one push per worker and round (`bad_state`) and discards one
# computed before its round closed (`too_stale`: the member's base may be a round behind until it pulls again), and
# a member the shards quarantined, or the scheduler then dropped, is refused as such; one that runs ahead of the
# others before the direction check can vouch for it is held (`held`, and pulls again as after `too_stale`).
ANY_PUSH = frozenset({"bad_state", "too_stale", "held", "quarantined", "unknown_sender"})
NOISE_TIMES = 1e3  # the noise's norm, in true gradient norms


def allowed_refusals(kind: str) -> frozenset[str]:
    """The codes a refusal of a `kind` message may carry."""
    return MUST_REFUSE[kind] if kind in REPLAYS else MUST_REFUSE.get(kind, frozenset()) | ANY_PUSH


@dataclass
class ByzantineMember:
    """The fuzzer's own live worker: its id, batch, connection column, per-shard base chunks and the true gradient
    per shard, and the PUSHes the shards took from it (frames, by shard), which it replays."""

    id: str
    batch: int  # the scheduler's assignment: a push may claim at most this many samples
    max_batch: int  # the job's --max-batch
    connection: int  # its column in the fuzzer's sockets, to the scheduler and to every shard
    metas: list[list[ChunkMeta]]  # per shard, the chunks as it pulled them (their versions: its pushes' bases)
    gradient: list[list[Any]]  # per shard, per chunk: the measured descent direction (a torch tensor)
    # per shard: (seq, frames) acknowledged, and the replays of it still to send (REPLAYS, in order)
    taken: list[list[tuple[int, list[bytes], list[str]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.taken = [[] for _ in self.metas]

    def push(self, kind: str, shard: int, rng: random.Random) -> tuple[Push, list[ChunkMeta], list[Any]]:
        """The PUSH of lie `kind` (one of GRADIENTS) to `shard` (0-based): body, chunk entries and tensors."""
        import torch

        g = self.gradient[shard]
        samples = self.batch
        if kind == "scaled_1e3":
            tensors = [t * 1e3 for t in g]
        elif kind == "scaled_1e6":
            tensors = [t * 1e6 for t in g]
        elif kind == "flipped":
            tensors = [-t for t in g]
        elif kind == "noise":
            tensors = [_noise(t, NOISE_TIMES * max(float(t.norm()), 1e-6), rng) for t in g]
        elif kind == "non_finite":
            tensors = [t.clone() for t in g]
            i = rng.randrange(len(tensors))
            tensors[i].view(-1)[rng.randrange(tensors[i].numel())] = rng.choice((math.nan, math.inf, -math.inf))
        elif kind == "over_claimed":
            tensors = list(g)
            samples = rng.choice((self.batch + 1, self.max_batch, 10 * self.max_batch))
        elif kind == "one_sample":  # one sample's gradient: the mean's plus noise sqrt(batch) times its norm
            tensors = [t + _noise(t, math.sqrt(self.batch) * float(t.norm()), rng) for t in g]
        else:
            raise ValueError(f"not a Byzantine gradient: {kind!r}")
        return Push(samples=samples), list(self.metas[shard]), [torch.as_tensor(t).contiguous() for t in tensors]

    def pulled(self, shard: int, chunks: list[ChunkMeta]) -> None:
        """`shard` answered the member's pull with `chunks`: its next pushes are based on their versions."""
        now = {c.id: c.version for c in chunks}
        self.metas[shard] = [replace(m, version=now.get(m.id, m.version)) for m in self.metas[shard]]

    def took(self, shard: int, seq: int, frames: list[bytes]) -> None:
        """`shard` acknowledged the PUSH `seq` (`frames`): it is replayed once as each kind of REPLAYS."""
        self.taken[shard].append((seq, frames, list(REPLAYS)))

    def replay(self, shard: int, rng: random.Random) -> tuple[int, list[bytes], str] | None:
        """A PUSH the shard took from it (its seq and frames, verbatim) and the kind of replay to send it as:
        each taken PUSH is replayed once as each kind (on its own connection, then on another), so that a fuzz in
        which the shards took a single one of its pushes still tries both (None: none taken yet)."""
        pool = self.taken[shard]
        if not pool:
            return None
        i = rng.randrange(len(pool))
        seq, frames, kinds = pool[i]
        kind = kinds.pop(0)
        if not kinds:
            pool.pop(i)
        return seq, frames, kind


def _noise(like: Any, norm: float, rng: random.Random) -> Any:
    import torch

    n = torch.randn(like.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 31)))
    return n * (norm / max(float(n.norm()), 1e-12))


def judge(outcomes: dict[str, dict[str, int]], counted: int, clipped: int) -> list[str]:
    """What went wrong with the member's messages: `outcomes` by kind ("taken", or the refusal's code), against
    the pushes the shards `counted` as taken from it and the ones they `clipped`. Empty: every lie was refused
    with a code its kind allows, or taken and counted, and every FAR lie taken was clipped."""
    wrong = []
    for kind, got in sorted(outcomes.items()):
        for outcome, n in sorted(got.items()):
            if outcome == "taken" and kind in MUST_REFUSE:
                wrong.append(f"{n} {kind} taken")
            elif outcome != "taken" and outcome not in allowed_refusals(kind):
                wrong.append(f"{n} {kind} answered {outcome}")
    taken = sum(got.get("taken", 0) for got in outcomes.values())
    if counted != taken:
        wrong.append(f"the shards counted {counted} pushes taken from the member, its answers say {taken}")
    far = sum(outcomes.get(kind, {}).get("taken", 0) for kind in FAR)
    if clipped < far:
        wrong.append(f"{far} pushes far beyond the bound were taken but only {clipped} clipped")
    return wrong
