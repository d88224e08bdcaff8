"""How a worker's gradient leaves it: chunks per message and bytes in flight, from the times its steps report.

The chunk layout is fixed when the shards are initialised (common/wire/chunking.py): every
process derives the same ids from `--chunk-bytes`, the shards validate against them
and checkpoints are cut by them, so a worker cannot cut its own. What a worker can
change without the shards agreeing to anything is how it sends those chunks: how many
of one shard's chunks its pipelined backward batches into one PUSH (`group`), and how
many gradient bytes it keeps pushed and unacknowledged (`credit`). Those are the
partition size and credit of ByteScheduler (SOSP 2019), expressed in the layout's
units. Pulls keep streaming one chunk per message: that is what lets the forward
pass of the first layer start while later chunks are still on their way.

The rule, per worker, from one step's report: the link's rate is the bytes a step
moved over the seconds it spent moving them (pull and push: what compute did not
hide; a lower bound of the link's bandwidth). Each message costs a fixed overhead
(`MESSAGE_OVERHEAD_S`: a round of framing, a poll and an acknowledgement) and the
last message of a backward pass cannot overlap anything, so a push of S bytes in
messages of m bytes exposes about (S / m) * overhead + m / rate; that is least at
m = sqrt(overhead * rate * S). The credit is what the link can carry while the
worker computes, plus a round trip's worth (its bandwidth-delay product), and at
least two messages, so that one is on the wire while the next is being sent; more
than the whole push buys nothing. It is never below the job's `--max-inflight-bytes`:
the round trip a credit must cover includes the shard's own service of each message,
which no heartbeat measures, and credits below it cost samples/s on the shaped-link
harness (bench/RESULTS.md, "The wire's schedule"). So the credit only grows, where a
fast link meets a long compute. Both are rounded to powers of two, and a plan
changes only once the same new plan has been proposed `STABLE_PROPOSALS` times in a
row (hysteresis, as batch sizes change only past a threshold): one noisy step does
not make a worker re-batch, while a link that stays slow is followed within a few
steps, and one that heals is followed back the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MESSAGE_OVERHEAD_S = 2e-4  # per message: framing, a poll and an acknowledgement; an estimate, not fitted per link
STABLE_PROPOSALS = 3
MAX_GROUP = 64  # chunks in one PUSH: the shard's per-message chunk limit is far above, this keeps replies prompt
MAX_CREDIT_BYTES = 256 << 20


@dataclass(frozen=True)
class WirePlan:
    """How one worker sends its gradient: `group` chunks of one shard per PUSH, at most `credit` bytes
    unacknowledged; `reason` says what in its last steps led here."""

    group: int
    credit: int
    reason: str = ""

    def same(self, other: WirePlan) -> bool:
        return (self.group, self.credit) == (other.group, other.credit)


@dataclass(frozen=True)
class StepSample:
    """What one step of a worker measured: seconds computing, seconds moving (pull and push, not hidden by
    compute), and the gradient and parameter bytes the step moved."""

    compute_s: float
    transfer_s: float
    moved_bytes: int


def _pow2_at_most(value: float, low: int, high: int) -> int:
    """The largest power of two at most `value` (`low` if none is), clamped to [low, high]."""
    if value < low:
        return low
    return max(low, min(high, 1 << int(math.floor(math.log2(value)))))


def plan_for(sample: StepSample, chunk_bytes: int, chunks: int, least_credit: int) -> WirePlan:
    """The plan that minimises the exposed transfer of one step like `sample`, for a layout of `chunks` chunks
    of about `chunk_bytes` each (`chunks` 0: unknown, no upper bound from the model), with a credit of at least
    `least_credit` (the job's `--max-inflight-bytes`)."""
    push_bytes = sample.moved_bytes / 2  # a step pulls the model and pushes its gradient: the same bytes each way
    if sample.transfer_s <= 0 or push_bytes <= 0:
        return WirePlan(1, least_credit, "no transfer measured yet")
    rate = sample.moved_bytes / sample.transfer_s
    best_message = math.sqrt(MESSAGE_OVERHEAD_S * rate * push_bytes)
    most = max(1, min(MAX_GROUP, chunks or MAX_GROUP))
    group = _pow2_at_most(best_message / chunk_bytes, 1, most)
    message = group * chunk_bytes
    in_flight = rate * (sample.compute_s + 2 * MESSAGE_OVERHEAD_S)
    ceiling = max(2 * message, _pow2_at_most(push_bytes, 1, MAX_CREDIT_BYTES))
    credit = max(least_credit, _pow2_at_most(max(in_flight, 2 * message), 2 * message, ceiling))
    return WirePlan(
        group,
        credit,
        f"link {rate * 8 / 1e6:.0f} Mbit/s, compute {sample.compute_s * 1e3:.0f} ms: "
        f"{group} chunk(s) per push, {credit >> 10} KiB in flight",
    )


def settle(current: WirePlan | None, proposals: list[WirePlan]) -> WirePlan | None:
    """The plan to hand out now: the newest proposal once the last `STABLE_PROPOSALS` agree and differ from
    `current` (None: keep `current`). The first proposal is taken at once: there is nothing to keep."""
    if not proposals:
        return None
    newest = proposals[-1]
    if current is None:
        return newest
    if newest.same(current):
        return None
    recent = proposals[-STABLE_PROPOSALS:]
    if len(recent) < STABLE_PROPOSALS or not all(p.same(newest) for p in recent):
        return None
    return newest
