"""Which way one PUSH points: a worker whose gradients keep opposing most other workers' is quarantined.

The norm bound (gradient_bounds.py) cannot see a gradient of honest size pointing
the wrong way: a worker that pushes the negation of its true gradient (a flipped
loss) climbs the loss, and under asgd nothing bounds how often it pushes. The
rule is a Zeno-style test (Xie et al., "Zeno++: Robust Fully Asynchronous SGD",
ICML 2020: a gradient is suspect when it does not descend along a reference
direction) scored by cosine as in FLTrust (Cao et al., NDSS 2021). The shard
holds no data to compute Zeno's validation gradient from, so the references
are the other workers' own directions, each judged separately, so that no
single liar can steer a reference (a mean of the others would be cancelled to
nothing by one flipped worker among three):

- per worker, `ref[w]` is the moving average (weight `REF_WEIGHT` per push) of its
  pushed chunks, each scaled to unit norm: every worker counts once, however big
  its batch or often it pushes;
- each push of w updates, for every other live worker v that has pushed
  `WARM_PUSHES` times, the agreement A(w, v): the moving average (weight
  `AGREE_WEIGHT`) of the cosine of the push with ref[v] over the chunks both have;
- w opposes v once A(w, v) counts (`MIN_SCORED` scored pushes) and is below
  `OPPOSED`; w is quarantined when it opposes a strict majority of at least
  `MIN_OTHERS` counted others, unless most of those others oppose a majority too
  (then the model itself moved: a rollback or a restore).

With f liars among n workers an honest worker opposes at most the f liars, a
majority only if f >= (n - 1) / 2; a sign-flipped liar's agreement with every
honest worker is minus theirs with each other, and its climb makes the gradient
larger and clearer. Honest agreements measured on the suite's jobs (blobs, and
the MLP and CNN on Fashion-MNIST under every protocol) stayed above -0.09;
OPPOSED sits at more than twice that. What this cannot catch: a liar whose
gradient is orthogonal to the true one (noise of honest size; the norm bound
keeps its size honest), one that flips only some pushes so that its agreement
stays above OPPOSED, a liar training alone before others join (no majority:
start with `--min-workers`), or liars as many as the honest workers. Chunks
larger than `SKETCH` values are compared on a fixed random `SKETCH` of their
coordinates (the same for every worker and across restarts), so memory and time
per push stay small.

Until the check can judge a worker it cannot stop it, and a liar that pushes far
more often than the others (they are slow to start, or starved of a loaded
machine's cores) climbed the loss for a hundred pushes and more before its
agreements counted, against references the others' few pushes had left stale
(bench/RESULTS.md 9g). So a worker the check cannot vouch for yet (below)
may be at most `LEAD` taken pushes ahead of the slowest other worker that holds a
batch: a push beyond that is held (`held`, nothing changes), but its direction is
still scored, so that an honest fast worker is vouched for, and a liar judged, at
the pace it pushes, not at the pace its pushes are taken. A worker that starts
working later (a newcomer, or one back from batch 0) starts level with the
slowest of the others, so that nobody is held back behind it; a protocol that
takes one push per worker and round (ssgd, local, msd) holds nothing, as nobody
can run ahead in it (the shard does not ask). The check vouches for a
worker once its agreements count with `MIN_OTHERS` others and are positive with
most of them (bias-corrected: a liar's are negative from its first scored push,
long before they reach `OPPOSED`); vouched workers run free for good, and with
fewer than `MIN_OTHERS` others nothing is held (nothing could judge them). A liar
that pushes honestly until it is vouched for, and lies after, is caught as before,
by its agreements falling below `OPPOSED`, while the others push beside it.
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
OPPOSED = -0.2  # an agreement below this: the pair opposes (honest pairs measured down to -0.081)
LEAD = 8  # taken pushes a worker not vouched for may be ahead of the slowest other worker holding a batch


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

    @property
    def mean(self) -> float:
        """The agreement without its start's pull towards 0 (bias-corrected, as Adam's moments): the moving
        average's weights over the cosines so far sum to 1 - (1 - AGREE_WEIGHT) ** scored."""
        return self.agreement / (1 - (1 - AGREE_WEIGHT) ** self.scored) if self.scored else 0.0

    def add(self, cos: float) -> None:
        self.agreement += AGREE_WEIGHT * (cos - self.agreement)
        self.scored += 1
        if self.scored >= MIN_SCORED:
            self.lowest = min(self.lowest, self.agreement)


@dataclass
class _Worker:
    """One worker's reference direction per chunk (unit-norm moving averages), pushes, and agreements."""

    ref: dict[int, torch.Tensor] = field(default_factory=dict)
    pushes: int = 0  # scored, taken or held
    taken: int = 0
    credit: int = 0  # taken pushes counted for it when it started working beside others (see `held`)
    vouched: bool = False  # once, for good: see `held`
    pairs: dict[str, _Pair] = field(default_factory=dict)  # by the other worker

    @property
    def count(self) -> int:
        """Taken pushes as `held` compares them: its own and those credited when it started working."""
        return self.taken + self.credit


@dataclass
class GradientDirection:
    """Per pair of workers, how one's pushes agree with the other's direction; who opposes most others."""

    on: bool
    workers: dict[str, _Worker] = field(default_factory=dict)
    index: dict[int, torch.Tensor | None] = field(default_factory=dict)
    working: set[str] = field(default_factory=set)  # as `held` was last told

    def record(self, worker: str, tensors: dict[int, torch.Tensor], live: set[str], taken: bool = True) -> bool:
        """Score a push of `worker` (chunk id -> gradient or delta; `taken`, or held) against each other live
        worker's direction and fold it into `worker`'s own; True if the worker is to be quarantined (it opposes
        most other workers, while most of them oppose no majority)."""
        if not self.on:
            return False
        sketched = {cid: self._sketch(cid, t) for cid, t in tensors.items()}
        me = self.workers.setdefault(worker, _Worker())
        me.taken += taken
        for name, other in self.workers.items():
            cos = (
                _cosine(sketched, other.ref)
                if name != worker and name in live and other.pushes >= WARM_PUSHES
                else None
            )
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

    def held(self, worker: str, working: set[str]) -> str | None:
        """Why a push of `worker` is held now (None: it may be taken): the check cannot vouch for it yet and it is
        `LEAD` taken pushes ahead of the slowest of the other `working` workers (live, holding a batch)."""
        if not self.on:
            return None
        self._start_level(working)
        others = working - {worker}
        me = self.workers.get(worker)
        if len(others) < MIN_OTHERS or (me is not None and self._vouch(me, working)):
            return None
        taken = me.count if me is not None else 0
        slowest = min(self.workers[name].count for name in others)
        if taken < slowest + LEAD:
            return None
        return (
            f"{worker!r} is {taken - slowest} pushes ahead of the slowest other worker before its direction "
            f"could be judged (--direction-check): pull and push again"
        )

    def _start_level(self, working: set[str]) -> None:
        """A worker that starts working (a newcomer, or one back from batch 0 or a restart) is
        credited the taken pushes of the slowest of those already working, as ssp's clocks start a joining
        worker: the lead that `held` bounds is over pushes made side by side. Counted from zero, a newcomer held
        back every worker not vouched for yet until it caught up with them."""
        started = working - self.working
        if started:
            before = working & self.working
            level = min((self.workers[n].count for n in before), default=0)
            for name in started:
                w = self.workers.setdefault(name, _Worker())
                w.credit = max(w.credit, level - w.taken)
        self.working = set(working)

    def agreements(self, worker: str) -> str:
        """`worker`'s agreement with each other worker (now, and the lowest once it counted)."""
        me = self.workers.get(worker)
        return (
            ", ".join(
                f"with {o} {p.agreement:.3f} (lowest {p.lowest:.3f})"
                for o, p in sorted(me.pairs.items())
                if p.scored >= MIN_SCORED
            )
            if me is not None
            else ""
        )

    def summary(self) -> str:
        """Every worker's agreements and held pushes, for the shard's closing line."""
        return (
            "; ".join(
                f"{name}{f' ({w.pushes - w.taken} pushes held)' if w.pushes > w.taken else ''} "
                f"{self.agreements(name)}".rstrip()
                for name, w in sorted(self.workers.items())
                if self.agreements(name) or w.pushes > w.taken
            )
            or "none scored"
        )

    def forget(self, live: set[str]) -> None:
        """Workers that left: their directions go (they no longer count as anyone's reference); their
        agreements stay for the closing line."""
        for name, w in self.workers.items():
            if name not in live:
                w.ref.clear()

    def _counted(self, worker: str, live: set[str]) -> dict[str, float]:
        """`worker`'s agreements that count: with live workers, over at least MIN_SCORED of its pushes."""
        me = self.workers.get(worker)
        return (
            {} if me is None else {o: p.agreement for o, p in me.pairs.items() if o in live and p.scored >= MIN_SCORED}
        )

    @staticmethod
    def _vouch(me: _Worker, working: set[str]) -> bool:
        """Whether the check vouches for a worker: once its agreements count with MIN_OTHERS working others and,
        bias-corrected, are positive with most of them. For good: an honest worker's agreements drift to 0 as
        training ends and the gradient turns to noise, and pacing it then would cost the job its speed."""
        if not me.vouched:
            means = [p.mean for o, p in me.pairs.items() if o in working and p.scored >= MIN_SCORED]
            me.vouched = len(means) >= MIN_OTHERS and 2 * sum(m > 0 for m in means) > len(means)
        return me.vouched

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
