"""How far one PUSH may move the model: each chunk's norm bounded by what the job's workers push.

A registered worker can send a gradient (or delta) that is finite, of the right
shape and within its sample count, and still wrong: scaled by 1e3, sign-flipped,
noise. The shard cannot tell a wrong direction from a right one, but it can bound
the size. For every chunk it keeps, per worker, the norms of that worker's last
`HISTORY` pushes of the chunk (as taken, i.e. after clipping), raw and times
sqrt(samples); the chunk's reference norms are the lower medians, across workers,
of each worker's medians (refreshed every `REFRESH` pushes of the chunk, so that a
push costs one norm per chunk, not a sort over every worker). Each worker counts
once, however often it pushes, so one worker cannot move the reference by pushing
fast or big: with n workers of which one lies, the reference is an honest one's.

A chunk's norm may be at most `factor` times the larger of the typical raw norm
and the typical normalised norm over sqrt(b): the noise of a mean gradient over b
samples grows as 1/sqrt(b), so a small-batch worker's honest norm is larger and
gets that room, while a large batch is never held below the typical norm. The
reference is trusted only once most live workers have pushed the chunk: before
that (the job's first pushes, which may all come from a fast liar) and always
besides, a chunk's norm may be at most `MAX_TO_PARAMS` times the chunk's own
parameter norm over sqrt(s), s = b / (B/n) at most 1 (the push's share of an even
batch): an honest gradient (or delta) of an even batch is far below its parameters'
norm, but one of 1 sample is not (its noise is sqrt(B/n) times larger: in the
reference job, with B/n = 64, 1-sample norms of 8 to 36 against a parameter norm
of 8, and the bound without sqrt(s) quarantined that honest `--max-batch 1` worker),
and its step is weighted by s (update_rules.py), so its room grows by 1/sqrt(s)
while the most it can move the chunk shrinks by sqrt(s). A chunk beyond
its bound is scaled to it (clipped), not refused: an honest worker's rare outlier
still counts, in direction.

A worker whose pushes are more than `QUARANTINE_EXCESS` times their bound
`QUARANTINE_AFTER` times in a row is quarantined: its further pushes are refused
(`quarantined`) and the shard reports it to the scheduler, which drops it from the
job. Only while most of at least two other live workers were not far out at their
last push: with two workers no majority can tell which one lies, and when most
are far out the model itself moved (a shard came back from an older checkpoint).
An honest worker gets there only if its norm stays 2 x `factor` times the other
workers' for that long.

The weight a push gets from its claimed samples is bounded by the sender's own
assignment (push_bounds.py), and its step size by the clipped norm times that
weight: the most a single push can move a chunk is lr x (its DBS weight) x factor x
(the typical norm, or the typical normalised norm over sqrt(b) for a small batch),
and never more than lr x (its DBS weight) x the chunk's own norm over sqrt(s).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import ProtocolError

HISTORY = 16  # a worker's last norms of one chunk that its median is taken over
REFRESH = 4  # pushes of a chunk between two computations of its reference
MAX_TO_PARAMS = 1.0  # a chunk's pushed norm at most this many times its parameters' norm
QUARANTINE_AFTER = 8  # pushes in a row far beyond the bound
QUARANTINE_EXCESS = 2.0  # far: a chunk's norm more than this many times its bound


@dataclass
class Assessment:
    """What bounding one push found: the chunks to take (clipped where needed) and their norms as taken."""

    worker: str
    samples: int
    tensors: dict[int, torch.Tensor]
    norms: dict[int, float]
    clipped: list[int]
    excess: float = 1.0  # the largest ratio of a chunk's norm to its bound


@dataclass
class _ChunkHistory:
    """Per worker, its last norms of one chunk, raw and times sqrt(samples) (noise-normalised)."""

    by_worker: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    medians: dict[str, tuple[float, float]] = field(default_factory=dict)  # of each worker's (raw, normalised)
    pushes: int = 0
    reference: tuple[float, float] = (math.inf, math.inf)  # lower medians of the workers' medians, as last computed

    def add(self, worker: str, norm: float, samples: int, live: set[str]) -> None:
        self.pushes += 1
        norms = self.by_worker.setdefault(worker, deque(maxlen=HISTORY))
        first = not norms
        norms.append((norm, norm * math.sqrt(samples)))
        self.medians[worker] = (_median_low([n for n, _ in norms]), _median_low([n for _, n in norms]))
        if first or self.pushes % REFRESH == 0:
            for gone in [w for w in self.by_worker if w not in live and w != worker]:
                del self.by_worker[gone], self.medians[gone]
            self.reference = (
                _median_low([m for m, _ in self.medians.values()]),
                _median_low([m for _, m in self.medians.values()]),
            )

    def trusted(self, live: set[str]) -> bool:
        """Whether most live workers have pushed this chunk, so that one liar cannot be the reference."""
        return 2 * sum(1 for w in self.by_worker if w in live) > len(live)


def _params_bound(param: torch.Tensor, share: float) -> float:
    """`MAX_TO_PARAMS` times the chunk's parameter norm over sqrt(share) (no bound for a chunk of zeros)."""
    norm = float(torch.linalg.vector_norm(param))
    return MAX_TO_PARAMS * norm / math.sqrt(share) if norm > 0 else math.inf


def _median_low(values: list[float]) -> float:
    values = sorted(values)
    return values[(len(values) - 1) // 2]


@dataclass
class GradientBounds:
    """Per-chunk norm bounds of pushes, the clipping they call for, and the workers quarantined for it."""

    factor: float  # 0: off (pushes are taken as they come, nothing is recorded)
    history: dict[int, _ChunkHistory] = field(default_factory=dict)
    in_a_row: dict[str, int] = field(default_factory=dict)
    quarantined: set[str] = field(default_factory=set)
    why: dict[str, str] = field(default_factory=dict)  # per quarantined worker, what its pushes kept doing
    clipped: int = 0  # pushes taken clipped, for the shard's closing line

    @property
    def on(self) -> bool:
        return self.factor > 0

    def assess(
        self,
        worker: str,
        tensors: dict[int, torch.Tensor],
        samples: int,
        params: Mapping[int, torch.Tensor],
        live: set[str],
        share: float,
    ) -> Assessment:
        """Bound `worker`'s push of `samples` samples, `share` (in (0, 1]) of an even batch B/n, to chunks whose
        parameters are `params`; changes nothing. Clipped chunks are new tensors; the rest are the received ones.
        A quarantined worker's push is refused (`check_not_quarantined`, which the shard's admission runs before
        it asks whether the sender is live; the simulator, bench/simulate.py, calls this alone)."""
        self.check_not_quarantined(worker)
        found = Assessment(worker, samples, dict(tensors), {}, [])
        if not self.on:
            return found
        for cid, tensor in tensors.items():
            norm = float(torch.linalg.vector_norm(tensor))
            bound = min(self.bound(cid, samples, live), _params_bound(params[cid], share))
            if norm > bound:
                found.tensors[cid] = tensor * (bound / norm)
                found.clipped.append(cid)
                found.excess = max(found.excess, norm / bound)
                norm = bound
            found.norms[cid] = norm
        return found

    def check_not_quarantined(self, worker: str) -> None:
        """Refuse (`quarantined`, saying why) a push from a worker this shard quarantined."""
        if worker in self.quarantined:
            raise ProtocolError(
                ErrorCode.QUARANTINED, f"{worker!r} was quarantined: its pushes kept {self.why[worker]}"
            )

    def bound(self, cid: int, samples: int, live: set[str]) -> float:
        """Chunk `cid`'s largest norm for a push of `samples` samples by the workers' reference (inf while most
        live workers have not pushed it): `factor` times the larger of the typical norm and the typical
        noise-normalised norm over sqrt(samples), so a small batch's noisier gradient has the room it needs and
        a large batch is never held below the typical norm."""
        hist = self.history.get(cid)
        if hist is None or not hist.trusted(live):
            return math.inf
        raw, normalised = hist.reference
        scale = max(raw, normalised / math.sqrt(max(1, samples)))
        return self.factor * scale if scale > 0 else math.inf

    def record(self, found: Assessment, live: set[str]) -> bool:
        """Remember a push that was taken; True if its worker is quarantined by it (newly)."""
        if not self.on:
            return False
        for cid, norm in found.norms.items():
            self.history.setdefault(cid, _ChunkHistory()).add(found.worker, norm, found.samples, live)
        self.clipped += bool(found.clipped)
        far = found.excess > QUARANTINE_EXCESS
        self.in_a_row[found.worker] = self.in_a_row.get(found.worker, 0) + 1 if far else 0
        if self.in_a_row[found.worker] < QUARANTINE_AFTER or found.worker in self.quarantined:
            return False
        others = [w for w in live if w != found.worker and w in self.in_a_row]
        if len(others) < 2 or 2 * sum(self.in_a_row[w] > 0 for w in others) >= len(others):
            return False  # no majority to tell a liar by, or most are far out too: the model moved, not a liar
        self.quarantine(found.worker, "exceeding the job's gradient-norm bound (--gradient-bound)")
        return True

    def quarantine(self, worker: str, why: str) -> None:
        """Refuse `worker`'s further pushes, saying `why` (what its pushes kept doing); the shard reports it
        to the scheduler, which drops it. Also the path of the direction check (gradient_direction.py)."""
        self.quarantined.add(worker)
        self.why[worker] = why

    def forget(self, live: set[str]) -> None:
        """Workers that left: their counts go (a quarantined id stays refused: ids are not reused while the
        scheduler lives, and a restarted scheduler's shards start afresh too)."""
        for gone in [w for w in self.in_a_row if w not in live]:
            del self.in_a_row[gone]
