"""Which way one PUSH points: a worker whose gradients keep opposing the other workers' is quarantined.

The norm bound (gradient_bounds.py) cannot see a gradient of honest size pointing
the wrong way: a worker that pushes the negation of its true gradient (a flipped
loss) climbs the loss at full speed, and under asgd nothing bounds how often it
pushes. The rule here is a Zeno-style score (Xie et al., "Zeno++: Robust Fully
Asynchronous SGD", ICML 2020: accept a gradient only if it agrees with a
reference descent direction) with FLTrust's cosine and a reference the suspect
cannot steer (Cao et al., "FLTrust", NDSS 2021, score each update by its cosine to
a trusted direction). The shard holds no data to compute Zeno's validation
gradient from, so the trusted direction is the other workers' own:

- per worker, `ref[w]` is the moving average (weight `REF_WEIGHT` per push) of its
  pushed chunks, each scaled to unit norm, so that every worker counts once,
  however big its batch or often it pushes;
- a push by w scores s = cos(its chunks, the mean of the other live workers'
  `ref`s over the same chunks), once at least `MIN_OTHERS` other workers have
  pushed `WARM_PUSHES` times each (with one other, no majority tells a liar);
- w's score is the moving average of its s (weight `SCORE_WEIGHT` per push);
  a worker is quarantined once, after at least `MIN_SCORED` scored pushes, its
  score is below -`QUARANTINE_SCORE` while most other scored workers' are not.

Why an honest worker is safe: with f liars among n workers its reference is
(n - 1 - f) honest directions minus f, which still points downhill while
f < (n - 1) / 2, so its expected score is >= 0 (exactly 0 for one liar in three,
where the honest and the flipped directions cancel); its noise around that
mean shrinks with the score's average over about 2 / SCORE_WEIGHT pushes, and
the measured spread of honest scores (docs/operators.md) is far inside
QUARANTINE_SCORE. A sign-flipped liar's reference is the honest mean, so its
score is minus the honest workers' agreement: strongly negative whenever the
gradient carries signal, which its lie keeps creating by pushing the model
uphill. What this cannot catch: a liar whose gradient is orthogonal to the true
one (pure noise of honest size: the norm bound keeps its size honest), one that
flips only some pushes so its average stays above -QUARANTINE_SCORE, or liars
that are as many as the honest workers. Chunks larger than `SKETCH` values are
compared on a fixed random `SKETCH` of their coordinates (the same for every
worker and across restarts), so memory and time per push stay small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SKETCH = 4096  # coordinates of a chunk compared at most
REF_WEIGHT = 0.1  # of a push in its worker's reference direction (about the last 10 pushes)
AGREE_WEIGHT = 1 / 32  # of a push's cosine in its worker's agreement with another (about the last 64 pushes)
WARM_PUSHES = 4  # a worker's pushes before its reference direction counts
MIN_OTHERS = 2  # other workers a worker must have been compared with: with one, no majority tells a liar
MIN_SCORED = 16  # a pair's scored pushes before its agreement counts
OPPOSED = -0.1  # an agreement below this: the pair opposes


def _sketch_index(cid: int, length: int) -> torch.Tensor | None:
    """The fixed coordinates of chunk `cid` that are compared (None: all of them)."""
    if length <= SKETCH:
        return None
    return torch.randperm(length, generator=torch.Generator().manual_seed(cid))[:SKETCH].sort().values


@dataclass
class _Pair:
    """How one worker's pushes agree with another's direction: the moving average of their cosines."""

    agreement: float = 0.0
    scored: int = 0
    lowest: float = float("inf")  # once it counts (how close an honest pair came to opposing)

    def add(self, cos: float) -> None:
        self.agreement += AGREE_WEIGHT * (cos - self.agreement)
        self.scored += 1
        if self.scored >= MIN_SCORED:
            self.lowest = min(self.lowest, self.agreement)


@dataclass
class _Worker:
    """One worker's reference direction per chunk (unit-norm moving averages), pushes, and agreements."""

    ref: dict[int, torch.Tensor] = field(default_factory=dict)
    pushes: int = 0
    pairs: dict[str, _Pair] = field(default_factory=dict)  # by the other worker


@dataclass
class GradientDirection:
    """Per pair of workers, how one's pushes agree with the other's direction; who opposes most others."""

    on: bool
    workers: dict[str, _Worker] = field(default_factory=dict)
    index: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def record(self, worker: str, tensors: dict[int, torch.Tensor], live: set[str]) -> bool:
        """Score a taken push of `worker` (chunk id -> gradient or delta) against each other live worker's
        direction and fold it into `worker`'s own; True if the worker is to be quarantined (it opposes most
        other workers, while most of them oppose no majority)."""
        if not self.on:
            return False
        sketched = {cid: self._sketch(cid, t) for cid, t in tensors.items()}
        me = self.workers.setdefault(worker, _Worker())
        for name, other in self.workers.items():
            cos = _cosine(sketched, other.ref) if name != worker and name in live and other.pushes >= WARM_PUSHES \
                else None
            if cos is not None:
                me.pairs.setdefault(name, _Pair()).add(cos)
        for cid, s in sketched.items():
            norm = float(torch.linalg.vector_norm(s))
            if norm > 0:
                old = me.ref.get(cid)
                me.ref[cid] = s / norm if old is None else old.mul(1 - REF_WEIGHT).add_(s, alpha=REF_WEIGHT / norm)
        me.pushes += 1
        if not self._opposes_most(worker, live):
            return False
        others = list(self._counted(worker, live))
        # Most others opposing a majority too: the model itself moved (a rollback, a restore), not a liar.
        return 2 * sum(self._opposes_most(name, live) for name in others) < len(others)

    def agreements(self, worker: str) -> str:
        """`worker`'s agreement with each other worker (now, and the lowest once it counted)."""
        me = self.workers.get(worker)
        return ", ".join(f"with {o} {p.agreement:.3f} (lowest {p.lowest:.3f})" for o, p in sorted(me.pairs.items())
                         if p.scored >= MIN_SCORED) if me is not None else ""

    def summary(self) -> str:
        """Every worker's agreements, for the shard's closing line."""
        return "; ".join(f"{name} {self.agreements(name)}" for name in sorted(self.workers)
                         if self.agreements(name)) or "none scored"

    def forget(self, live: set[str]) -> None:
        """Workers that left: their directions go (they no longer count as anyone's reference); their
        agreements stay for the closing line."""
        for name, w in self.workers.items():
            if name not in live:
                w.ref.clear()

    def _counted(self, worker: str, live: set[str]) -> dict[str, float]:
        """`worker`'s agreements that count: with live workers, over at least MIN_SCORED of its pushes."""
        me = self.workers.get(worker)
        return {} if me is None else {o: p.agreement for o, p in me.pairs.items()
                                      if o in live and p.scored >= MIN_SCORED}

    def _opposes_most(self, worker: str, live: set[str]) -> bool:
        counted = self._counted(worker, live)
        return len(counted) >= MIN_OTHERS and 2 * sum(a < OPPOSED for a in counted.values()) > len(counted)

    def _sketch(self, cid: int, tensor: torch.Tensor) -> torch.Tensor:
        if cid not in self.index:
            self.index[cid] = _sketch_index(cid, tensor.numel())
        idx = self.index[cid]
        flat = tensor.reshape(-1).float()
        return flat if idx is None else flat[idx]


def _cosine(push: dict[int, torch.Tensor], ref: dict[int, torch.Tensor]) -> float | None:
    """Cosine of a push's sketched chunks with a reference direction over the chunks both have (None: none)."""
    dot = push_sq = ref_sq = 0.0
    for cid, s in push.items():
        r = ref.get(cid)
        if r is not None:
            dot += float(s @ r)
            push_sq += float(s @ s)
            ref_sq += float(r @ r)
    return dot / (push_sq * ref_sq) ** 0.5 if push_sq > 0 and ref_sq > 0 else None
