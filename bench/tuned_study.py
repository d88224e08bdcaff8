"""Every training method at its own tuned step size, on every cluster profile: which one should be the default.

A comparison at one shared learning rate favours whichever method that rate suits
(section 5's lr 0.02 was chosen for asgd). Here each method's step size is chosen
from a grid on tuning seeds (100, 101, ...), then the method is run on the report
seeds (0, 1, ...) at that step size, so no reported run is the one it was tuned on. A tuning run ends when it
reaches the target (its time to it is all the choice needs); a report run always runs to the budget, so a method
that diverges after reaching the target is seen there.
A step size whose run diverged in any tuning seed is never chosen; among the rest
the one with the best median time to the target wins, then the best mean accuracy.
The 256-worker profile is not tuned: it takes each method's step size from the
64-worker tuning, which is also the check that a choice was not fitted to the
profile it was tuned on. So do the unseen log-normal clusters (`unseen_lognormal`:
sizes, spreads and speeds no tuning run saw), on which the default must never diverge.

The default is then the method with the best median time to the target over every
profile, among those that never diverged in any run (`choose_default`).

    python -m bench.simulate --study tuned --jobs 2   # about 75 minutes on 2 cores (125 of CPU)
    python -m bench.simulate --study tuned-256        # lognormal256 at the step sizes of TUNED_LRS
    python -m bench.simulate --study tuned-recheck --jobs 2  # bench4 and tail16 as tuned-scale: 9h again, reduced
    python -m bench.simulate --study tuned-unseen     # the default on log-normal clusters never tuned on
    python -m bench.simulate --study tuned-changing   # shifting32 and churn32 at the step sizes of TUNED_LRS
    python -m bench.simulate --study tuned --resume    # go on with an interrupted study, keeping its runs
    python -m bench.simulate --study tuned-quick      # a CI-sized check of the machinery, under 2 minutes
    python -m bench.simulate --study tuned-policies --jobs 2  # the efficient policy and the delay step
    python -m bench.simulate --study regimes --jobs 2  # the regime study: every cluster file of bench/profiles/,
                                                      # auto tuned beside every other method (`tuned_auto`)
    python -m bench.simulate --study regimes-cut --jobs 2  # what ran by the deadline (bench/RESULTS.md 20)
    python -m bench.simulate --study regimes --methods default --resume  # the default's report runs alone, beside
                                                      # the study's, at the step sizes its tuning runs chose
    python -m bench.simulate --study regimes-reduced --jobs 2  # the same: 3 seeds, tuned on one, 2 step sizes
    python -m bench.simulate --study regimes-fine --jobs 2  # mixed_links16 and mixed_gpus16 on grids a factor sqrt 2
                                                      # apart, every method's, tuned on 2 seeds, 10 report seeds
    python -m bench.simulate --study regimes-drawn --jobs 2  # auto's methods on 10 drawn clusters no tuning saw
    python -m bench.tuned_study DIR                   # re-render DIR/report.md and the plots from DIR/results.json
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.auto_evidence import AUTO_METHODS, budget_s, evidence_row, render_evidence
from bench.drawn_clusters import draw_clusters
from bench.parallel_runs import run_parallel
from bench.profile_file import ClusterProfile, read_profile, simulated
from bench.reference_time import STUDY_SETTING, cluster_optimum, device_of
from bench.shared_lr import render_shared
from bench.simulate import PROFILES, SimConfig, SimResult, WorkerSpec, lognormal, simulate
from dynabatch.common.config import AUTO_PROTOCOL, JobConfig
from dynabatch.common.planning.optimum import PER_WORKER_BATCHES, STUDY_NOISE, Device, calibrated_optimum
from dynabatch.common.planning.protocol_switch import running, switch_plan
from dynabatch.common.tasks.data import load_dataset

STEP_LRS = (0.005, 0.01, 0.02, 0.04)
"""Step sizes tried for a method that steps once per worker's gradient (B/n samples on average)."""
ROUND_LRS = (0.05, 0.1, 0.2, 0.4)
"""Step sizes tried for a method that steps once per B samples (a round): a step of n times the samples takes a
larger rate (between the square root and linear scaling rules for n = 16 to 64)."""
LOCAL_LRS = (0.02, 0.04, 0.08, 0.16)
"""Step sizes tried for local SGD's local steps: staleness-free steps of B/n samples, whose best step size in
sequential SGD is 0.16 at 32 and 128 samples (bench/RESULTS.md 10d)."""


@dataclass(frozen=True)
class Method:
    """A training method: a protocol, a batch policy, the job settings that make it what it is, and the step sizes
    its tuning tries."""

    name: str
    protocol: str
    policy: str
    settings: tuple[tuple[str, Any], ...] = ()
    lrs: tuple[float, ...] = STEP_LRS


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("asgd+fixed", "asgd", "fixed"),
        Method("DBS-SGD (capped weight)", "asgd", "dynamic", (("dbs_weight", "capped"),)),
        Method("DBS-SGD (paper weight)", "asgd", "dynamic", (("dbs_weight", "paper"),)),
        Method("ringmaster+fixed", "ringmaster", "fixed"),
        Method("ringmaster+dynamic", "ringmaster", "dynamic"),
        Method("rennala+dynamic", "rennala", "dynamic", lrs=ROUND_LRS),
        Method("LB-BSP (ssgd+dynamic)", "ssgd", "dynamic", lrs=ROUND_LRS),
        Method("n-softsync", "softsync", "fixed", lrs=ROUND_LRS),
        Method("multi-step delay", "msd", "dynamic"),
        Method("asgd+efficient", "asgd", "efficient", lrs=STEP_LRS[1:]),
        Method("DBS-SGD (delay step)", "asgd", "dynamic", (("staleness_step", "delay"),), lrs=ROUND_LRS[1:]),
        Method("ssgd+fixed", "ssgd", "fixed", lrs=ROUND_LRS),
        Method("rennala+fixed", "rennala", "fixed", lrs=ROUND_LRS),
        Method("local+fixed", "local", "fixed", lrs=LOCAL_LRS),
        Method("local+dynamic", "local", "dynamic", lrs=LOCAL_LRS),
        Method("msync+fixed", "msync", "fixed", lrs=ROUND_LRS),
        Method("asgd+fixed (delay step)", "asgd", "fixed", (("staleness_step", "delay"),), lrs=ROUND_LRS[1:]),
        Method("ringmaster+fixed (delay step)", "ringmaster", "fixed", (("staleness_step", "delay"),), ROUND_LRS[1:]),
    )
}
"""Every method the study can compare; a protocol added later adds its Method here. msync's m is the cluster's own
(`msync_m`), set where the run is configured."""


def default_method() -> Method:
    """What a job runs with every flag at its default (JobConfig's protocol, batch policy and step against
    staleness), named for it, so that its rows are kept apart from an earlier default's once the defaults change.
    Its step size on a cluster is the one tuned for the fixed-batch method of the same protocol and step
    (`lr_source`): the default's policy starts every job with fixed batches."""
    job = JobConfig()
    settings = () if job.staleness_step == "constant" else (("staleness_step", job.staleness_step),)
    step = "" if job.staleness_step == "constant" else f", {job.staleness_step} step"
    return Method(f"default ({job.protocol}+{job.batch_policy}{step})", job.protocol, job.batch_policy, settings, ())


def lr_source(method: Method) -> str:
    """The method whose tuned step size `method` runs at where it is not tuned itself (the default): itself if
    it is tuned, else the fixed-batch method of its protocol and settings (`--protocol auto`: of the protocol it
    starts on, with the delay step it runs under). ValueError naming what to add where no such method is in
    METHODS."""
    if method.lrs:
        return method.name
    protocol, settings = method.protocol, method.settings
    if protocol == AUTO_PROTOCOL:  # it starts on its measuring protocol, with the step every switch keeps
        started = running(JobConfig(protocol=protocol), switch_plan(JobConfig(protocol=protocol)).start)
        protocol, settings = started.protocol, (("staleness_step", started.staleness_step),)
    for m in METHODS.values():
        if m.lrs and (m.protocol, m.policy, m.settings) == (protocol, "fixed", settings):
            return m.name
    raise ValueError(f"{method.name}: no tuned fixed-batch method of protocol {protocol} in METHODS")


DEFAULT = default_method()
METHODS[DEFAULT.name] = DEFAULT


def tuned_auto() -> Method:
    """`--protocol auto --batch-policy auto` as a method tuned like every other, over the grid of the method whose
    step size it would otherwise take (`lr_source`: the fixed-batch method it starts on, under the delay step every
    switch keeps), which is every delay-step method's grid. The default's row runs the same job untuned, at that
    method's tuned step size."""
    untuned = Method("auto (protocol and policy)", AUTO_PROTOCOL, "auto", lrs=())
    return replace(untuned, lrs=METHODS[lr_source(untuned)].lrs)


TUNED_AUTO = tuned_auto()
METHODS[TUNED_AUTO.name] = TUNED_AUTO


@dataclass(frozen=True)
class Profile:
    """One cluster of the study: its nodes (bench/simulate.py PROFILES), B, the target, and how it is tuned.

    Each method's step sizes are tuned over its own grid (`Method.lrs`, or `lrs` where set, as the quick study
    does), unless `lr_from` names the profile whose tuning they come from.
    """

    profile: str
    global_batch: int
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    tune_seeds: tuple[int, ...] = (100, 101)
    lr_from: str = ""
    lrs: tuple[float, ...] = ()
    budget_s: float = 150.0
    slower: float = 10.0  # every node's step and transfer times, times this (as section 5's parts)
    target: str = "0.80"
    eval_every_s: float = 2.0
    eval_size: int = 1000
    reached_over: int = 1  # the evaluations a time to the target is the mean of (bench/simulate.py `reached_at`)
    model: str = "mlp"
    dataset: str = "fashion-mnist"
    largest_lrs: int = 0  # tune over only this many of the largest step sizes of each method's grid (0: all)
    extend_lrs: bool = False  # tune over each grid and twice its largest step size too
    edge_steps: int = 2  # times a grid grows past a winning edge (`tune`)
    refine: int = 0  # times each gap of every grid is split at its geometric mean (1: factor sqrt 2 for doubling)

    def grid(self, method: str) -> tuple[float, ...]:
        """The step sizes `method` is tuned over on this profile (none for a method that takes another's: the
        default, `lr_source`)."""
        if not METHODS[method].lrs:
            return ()
        lrs = self.lrs or METHODS[method].lrs
        lrs = refined((*lrs, 2 * lrs[-1]) if self.extend_lrs else lrs, self.refine)
        return lrs[-self.largest_lrs :] if self.largest_lrs else lrs


def refined(lrs: tuple[float, ...], times: int) -> tuple[float, ...]:
    """`lrs` with the geometric mean of each neighbouring pair put between them, `times` over, each rounded to two
    significant digits so that a chosen step size reads (and is passed to --lr) as it was run: a grid whose steps
    double becomes one whose steps are a factor sqrt 2 apart, over the same range, for every method alike."""
    for _ in range(times):
        means = (float(f"{math.sqrt(a * b):.2g}") for a, b in zip(lrs, lrs[1:], strict=False))
        lrs = (*(x for pair in zip(lrs, means, strict=False) for x in pair), lrs[-1])
    return lrs


TUNED_LRS: dict[str, dict[str, float]] = {
    "regimes": {
        "asgd+fixed": 0.02,
        "DBS-SGD (capped weight)": 0.02,
        "ssgd+fixed": 0.2,
        "LB-BSP (ssgd+dynamic)": 0.2,
        "local+dynamic": 0.08,
        "local+fixed": 0.08,
        "ringmaster+fixed": 0.02,
        "ringmaster+dynamic": 0.02,
    },
    "lognormal64": {
        "asgd+fixed": 0.01,
        "DBS-SGD (capped weight)": 0.005,
        "ringmaster+fixed": 0.02,
        "ringmaster+dynamic": 0.005,
        "rennala+dynamic": 0.2,
        "LB-BSP (ssgd+dynamic)": 0.4,
    },
}
"""The step sizes the tuned-scale study of 2026-11-25 chose (bench/RESULTS.md section 9) and, under "regimes", the
smallest each of auto's methods and local SGD (the fastest where the shards bound the job) chose over the four
cluster files in the reduced regime study (section 14), for a study whose `lr_from` names a profile it does not
tune itself. local+fixed takes local+dynamic's; Ringmaster, tuned on mixed_gpus16 alone (0.04 there, diverging at
that step on ps_bound64: section 17), takes asgd+fixed's, the smaller (set before any drawn run of it, section 19)."""


def unseen_lognormal(count: int, seed: int) -> dict[str, Callable[[], tuple[WorkerSpec, ...]]]:
    """`count` log-normal clusters that no tuning saw: 12, 24 and 48 nodes in turn, a spread (sigma) drawn from
    `seed` between 0.25 and 1.25 (the tuned profiles have 0.5 and 0.75), their speeds from seeds 1000 and up (the
    tuned profiles' are 32 to 256). Named `lognormal{n}-s{sigma}-r{speeds' seed}`."""
    rng = random.Random(seed)
    out: dict[str, Callable[[], tuple[WorkerSpec, ...]]] = {}
    for i in range(count):
        n, sigma, speeds = (12, 24, 48)[i % 3], round(rng.uniform(0.25, 1.25), 2), 1000 + seed + i
        out[f"lognormal{n}-s{sigma:g}-r{speeds}"] = partial(lognormal, n, sigma, speeds)
    return out


UNSEEN = unseen_lognormal(6, seed=0)
FILES: dict[str, ClusterProfile] = {
    path.stem: read_profile(path) for path in sorted((Path(__file__).parent / "profiles").glob("*.json"))
}
"""The cluster files of bench/profiles/ by name (mixed GPU generations, CPU beside GPU, a shard-bound job, mixed
links): each worker's own step curve, cap and link, and the job's shards (bench/profile_file.py)."""
DRAWN: dict[str, ClusterProfile] = {c.name: simulated(c) for c in draw_clusters(10)}
"""Mixed clusters no tuning saw (bench/drawn_clusters.py): the out-of-sample check of `auto`."""
CLUSTER_FILES = {**FILES, **DRAWN}
CLUSTERS: dict[str, Callable[[], tuple[WorkerSpec, ...]]] = {
    **PROFILES,
    **UNSEEN,
    **{name: partial(getattr, f, "workers") for name, f in CLUSTER_FILES.items()},
}
"""Every cluster a study can name: bench/simulate.py's profiles, the unseen log-normal ones, the cluster files and
the drawn clusters."""
ALL = tuple(name for name, m in METHODS.items() if m.lrs)
SEEDS = (0, 1, 2, 3, 4)
CANDIDATES = (
    "asgd+fixed",
    "DBS-SGD (capped weight)",
    "ringmaster+fixed",
    "ringmaster+dynamic",
    "rennala+dynamic",
    "LB-BSP (ssgd+dynamic)",
)
"""The methods the scale study compares: the default's candidates and the round protocol they must beat."""
POLICIES = ("asgd+fixed", "asgd+efficient", "DBS-SGD (capped weight)", "DBS-SGD (delay step)")
"""The methods the policies study compares: the default, the efficient policy, DBS-SGD and DBS-SGD with the
delay-scaled step. They are tuned at 16 workers (tail16) and run at those step sizes on links16 and at 64 workers,
which is the test of whether a step size carries over to four times the workers (the delay step's claim)."""
AT_256 = ("asgd+fixed", "DBS-SGD (capped weight)", "ringmaster+fixed", "rennala+dynamic")
"""The methods run with 256 workers: the issue's (asgd+fixed, the default before auto; rennala; ringmaster) and
DBS-SGD."""
REGIME_METHODS = (
    "asgd+fixed",
    "DBS-SGD (capped weight)",
    "DBS-SGD (delay step)",
    "asgd+efficient",
    "ringmaster+fixed",
    "ssgd+fixed",
    "LB-BSP (ssgd+dynamic)",
    "msync+fixed",
    "rennala+dynamic",
    "local+dynamic",
    "ringmaster+dynamic",
    "local+fixed",
    "asgd+fixed (delay step)",
    "ringmaster+fixed (delay step)",
    DEFAULT.name,
)
"""The methods of the regime study: asgd and ssgd with one batch for every worker (fixed) and sized per worker
(dynamic: DBS-SGD, LB-BSP), the efficient policy (each worker at its own knee), DBS-SGD with the delay-scaled step,
m-synchronous SGD, Ringmaster, Rennala and local SGD sized per worker (the fastest in the reduced study's two
shard-bound regimes, bench/RESULTS.md 14); and asgd and Ringmaster with fixed batches under the delay step, whose
step size is one per B samples as ssgd's and local SGD's are: whether one --lr serves a job whichever protocol it
runs; and the default (a job with every flag at its default), at its fixed-batch method's tuned step size."""
REGIME_BUDGET_S = {"mixed_gpus16": 60.0, "mixed_links16": 150.0, "ps_bound64": 180.0, "cpu_gpu8": 60.0}
"""Virtual seconds per run of each cluster file (the files' clocks are their devices' and links'): two to three times
what the fastest method takes to 80% where one did (bench/RESULTS.md 14: mixed_gpus16 31 s, cpu_gpu8 17 s), and
where none did in 60 s, long enough for the asynchronous methods at their 60 s samples/s (745 on ps_bound64, 662 on
mixed_links16) to train about what they need on the 64-worker lognormal64 (110,000 samples, section 9h). Each is
judged 60 times a run (every 1 to 3 virtual s)."""


def regimes(
    methods: tuple[str, ...],
    seeds: tuple[int, ...],
    tune_seeds: tuple[int, ...],
    largest_lrs: int = 0,
    extend_lrs: bool = True,
) -> tuple[Profile, ...]:
    """The regime study: every cluster file at its own global batch for REGIME_BUDGET_S's virtual seconds, in real
    seconds (`slower` 1), judged 60 times a run; each method's grid extended by twice its largest step size (the
    first reduced study chose the largest of several grids), and cut to its `largest_lrs` largest where set."""
    return tuple(
        Profile(
            name,
            FILES[name].global_batch,
            methods,
            seeds,
            tune_seeds,
            budget_s=budget,
            slower=1.0,
            eval_every_s=budget / 60,
            largest_lrs=largest_lrs,
            extend_lrs=extend_lrs,
        )
        for name, budget in REGIME_BUDGET_S.items()
    )


DRAWN_BUDGET_S = {
    "drawn0": 41.0,
    "drawn1": 128.0,
    "drawn2": 150.0,
    "drawn3": 51.0,
    "drawn4": 150.0,
    "drawn5": 108.0,
    "drawn6": 85.0,
    "drawn7": 127.0,
    "drawn8": 150.0,
    "drawn9": 51.0,
}
"""The budgets the drawn clusters ran at (bench/RESULTS.md 17): `auto_evidence.budget_s` of the predictor before its
rounds queued their pushes (commit a7efc7d), kept so that the study runs again as it ran; a cluster not listed
takes `budget_s` of the predictor as it is."""


CUT_ORDER = ("cpu_gpu8", "ps_bound64", "mixed_links16", "mixed_gpus16")
"""The order `regimes-cut` runs the files in: those the reduced study (bench/RESULTS.md 17) did not tune first, the
cheapest first; mixed_gpus16, tuned there, last."""


FINE_FILES = ("mixed_links16", "mixed_gpus16")
"""The files `regimes-fine` runs, the cheaper first: those where auto's verdict against the best rests on where a
doubling grid's steps fall (bench/RESULTS.md 41, 43), tuned again on grids a factor sqrt 2 apart, every method's."""


def drawn(methods: tuple[str, ...], seeds: tuple[int, ...], lr_from: str) -> tuple[Profile, ...]:
    """The drawn clusters (DRAWN), each at its own global batch for DRAWN_BUDGET_S's virtual seconds, at the step
    sizes tuned on `lr_from` (no tuning on a drawn cluster: that is what makes it unseen)."""
    out = []
    for name, cluster in DRAWN.items():
        assert cluster.file is not None
        budget = DRAWN_BUDGET_S.get(name) or budget_s(cluster.file)
        out.append(
            Profile(
                name,
                cluster.global_batch,
                methods,
                seeds,
                (),
                lr_from=lr_from,
                budget_s=budget,
                slower=1.0,
                eval_every_s=budget / 60,
            )
        )
    return tuple(out)


def msync_m(profile: str) -> int:
    """The m of m-synchronous SGD on a cluster: the m of its T* (Tyurin and Richtarik's fastest m workers) with each
    worker's transfers counted in its fixed cost (msync pushes whole, never pipelined), so that a worker behind a
    slow link is left out as a slow device is."""
    base, files = SimConfig("asgd", "fixed", ()), CLUSTER_FILES.get(profile)
    wire = files.file.model_bytes if files and files.file else 0.0
    devices = []
    for w in CLUSTERS[profile]():
        if w.join_s:
            continue
        d = device_of(w, base.fixed_s, base.per_sample_s)
        transfer = 2 * (w.latency_s + wire * 8 / (w.link_mbit * 1e6)) if w.link_mbit else 0.0
        devices.append(Device(d.fixed_s + transfer, d.per_sample_s, d.max_batch))
    return calibrated_optimum(STUDY_NOISE, devices, PER_WORKER_BATCHES).workers


QUICK = Profile(
    "bench4",
    64,
    ("asgd+fixed", "DBS-SGD (capped weight)", "asgd+fixed (delay step)"),
    (0,),
    (100,),
    budget_s=2.0,
    slower=1.0,
    target="0.60",
    eval_every_s=0.5,
    eval_size=300,
    dataset="synthetic",
    lrs=(0.02, 0.05),
    edge_steps=1,
)
"""The quick study's bench4 profile; its mixed_gpus16 twin differs in profile, global batch and budget only. asgd with
the delay step is there as the default's (`--protocol auto`'s) step-size source (`lr_source`)."""

STUDIES: dict[str, tuple[Profile, ...]] = {
    "regimes": regimes((*REGIME_METHODS, TUNED_AUTO.name), SEEDS, (100, 101)),
    "regimes-cut": tuple(
        replace(p, seeds=(0, 1, 2)) if p.profile == "mixed_gpus16" else p
        for p in sorted(regimes(REGIME_METHODS, SEEDS, (100,)), key=lambda p: CUT_ORDER.index(p.profile))
    ),
    "regimes-reduced": tuple(
        p if p.profile == "mixed_gpus16" else replace(p, tune_seeds=(), lr_from="mixed_gpus16")
        for p in regimes(REGIME_METHODS, (0, 1, 2), (100,), largest_lrs=4)
    ),
    "regimes-fine": tuple(
        replace(p, refine=1)
        for p in sorted(
            (
                p
                for p in regimes((*REGIME_METHODS, TUNED_AUTO.name), tuple(range(10)), (100, 101))
                if p.profile in FINE_FILES
            ),
            key=lambda p: FINE_FILES.index(p.profile),
        )
    ),
    "regimes-drawn": drawn(tuple(AUTO_METHODS.values()), (0,), lr_from="regimes"),
    "tuned": (
        Profile("bench4", 128, ALL, SEEDS),
        Profile("tail16", 512, ALL, SEEDS),
        Profile("lognormal64", 2048, ALL, SEEDS),
        Profile("shifting32", 1024, ALL, SEEDS),
        Profile("churn32", 1024, ALL, SEEDS),
        Profile("lognormal256", 8192, AT_256, (0, 1, 2), lr_from="lognormal64"),
    ),
    "tuned-scale": (
        Profile("tail16", 512, CANDIDATES, (0, 1, 2), (100,)),
        Profile("lognormal64", 2048, CANDIDATES, (0, 1, 2), (100,)),
    ),
    "tuned-policies": (
        Profile("tail16", 512, POLICIES, (0, 1), (100,), budget_s=100.0),
        Profile("links16", 512, POLICIES[:3], (0, 1), lr_from="tail16", budget_s=100.0),
        Profile("lognormal64", 2048, POLICIES, (0, 1), lr_from="tail16", budget_s=100.0),
    ),
    "tuned-recheck": (
        Profile("bench4", 128, CANDIDATES, (0, 1, 2), (100,)),
        Profile("tail16", 512, CANDIDATES, (0, 1, 2), (100,)),
    ),
    "tuned-256": (Profile("lognormal256", 8192, AT_256, (0, 1, 2), lr_from="lognormal64"),),
    "tuned-changing": tuple(
        Profile(
            name, 1024, ("asgd+fixed", "DBS-SGD (capped weight)", "ringmaster+fixed"), (0, 1, 2), lr_from="lognormal64"
        )
        for name in ("shifting32", "churn32")
    ),
    "tuned-unseen": tuple(
        Profile(name, 32 * len(nodes()), ("asgd+fixed",), (7, 8), lr_from="lognormal64")
        for name, nodes in UNSEEN.items()
    ),
    "tuned-quick": (QUICK, replace(QUICK, profile="mixed_gpus16", global_batch=512, budget_s=1.0)),
}


@dataclass(frozen=True)
class Run:
    """One simulation: a profile's method at a step size and seed; `tuning` runs only choose the step size."""

    profile: Profile
    method: str
    lr: float
    seed: int
    tuning: bool


def sim_config(run: Run) -> SimConfig:
    """The run as the simulator takes it: the profile's nodes, times scaled by `slower`, the method's settings."""
    p, method = run.profile, METHODS[run.method]
    base = SimConfig(method.protocol, method.policy, CLUSTERS[p.profile]())
    transfers = CLUSTER_FILES[p.profile].sim_settings() if p.profile in CLUSTER_FILES else {}
    own = {"sync_m": msync_m(p.profile)} if method.protocol == "msync" else {}
    return SimConfig(
        method.protocol,
        method.policy,
        base.workers,
        seed=run.seed,
        budget_s=p.budget_s,
        global_batch=p.global_batch,
        fixed_s=base.fixed_s * p.slower,
        per_sample_s=base.per_sample_s * p.slower,
        comm_s=base.comm_s * p.slower,
        model=p.model,
        eval_every_s=p.eval_every_s,
        eval_size=p.eval_size,
        reached_over=p.reached_over,
        dataset=p.dataset,
        job={"lr": run.lr, "momentum": 0.0, **dict(method.settings), **own},
        stop_at=float(p.target) if run.tuning else 0.0,
        **transfers,
    )


def diverged(r: dict[str, Any]) -> bool:
    """Whether a run blew up: its training loss not finite or far above the untrained model's (about 2.3 for
    ten classes), its model at the budget no better than chance after it moved (`never_updated`: a model that no
    update reached did not blow up, it never trained), or an honest worker quarantined by the gradient bound (its
    gradients grew past it: the model was blowing up)."""
    loss = r["final_train_loss"]
    if r.get("quarantined", 0) > 0 or (loss is not None and (not math.isfinite(loss) or loss > 10.0)):
        return True
    return not never_updated(r) and (loss is None or r["final_test_acc"] < 0.15)


def never_updated(r: dict[str, Any]) -> bool:
    """Whether the evaluated model stayed the untrained one to the budget: every evaluation gave the first one's
    accuracy (a round that waits for a worker behind a slow link may not close within the budget)."""
    return all(acc == r["curve"][0][2] for _, _, acc in r["curve"])


def time_to(r: dict[str, Any], mark: str) -> float:
    """Virtual seconds until the run's test accuracy first reached `mark` (inf: never)."""
    return next((t for t, _, acc in r["curve"] if acc >= float(mark)), math.inf)


def median_time(runs: list[dict[str, Any]], mark: str) -> float:
    """The median time to `mark` over runs, a run that never reached it counting as never (inf)."""
    return statistics.median(time_to(r, mark) for r in runs) if runs else math.inf


def choose_lr(runs: list[dict[str, Any]], mark: str) -> float | None:
    """The step size whose tuning runs never diverged and reached `mark` soonest (median), then most accurately;
    None when every step size diverged in some seed."""
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    stable = {lr: rs for lr, rs in by_lr.items() if not any(diverged(r) for r in rs)}
    if not stable:
        return None
    return min(
        stable,
        key=lambda lr: (median_time(stable[lr], mark), -statistics.fmean(r["final_test_acc"] for r in stable[lr])),
    )


_DATA: dict[str, Any] = {}


Timed = tuple[SimResult, float]
"""A run's result and the CPU seconds it took (what each part of a study costs)."""


def simulate_run(run: Run) -> tuple[Run, Timed]:
    """One run of a study and its CPU seconds (the dataset loaded once a process)."""
    if run.profile.dataset not in _DATA:
        _DATA[run.profile.dataset] = load_dataset(run.profile.dataset)
    started = time.process_time()  # CPU time: what the run costs whatever else the machine runs beside it
    r = simulate(sim_config(run), _DATA[run.profile.dataset])
    return run, (r, time.process_time() - started)


def run_all(plan: list[Run], jobs: int, log: Callable[[str], None]) -> Iterator[tuple[Run, Timed]]:
    """Every run of `plan` in `jobs` processes, yielded as each finishes, with a progress line."""
    return run_parallel(simulate_run, plan, jobs, _describe, log)


def _describe(run: Run, timed: Timed) -> str:
    r = timed[0]
    return (
        f"{run.profile.profile}{' tuning' if run.tuning else ''} {run.method} lr {run.lr:g} seed {run.seed}: "
        f"{100 * r.final_test_acc:.2f}%, {r.samples_per_s:.0f} samples/s, "
        f"{run.profile.target} at {time_to(asdict(r), run.profile.target):g} s"
    )


@dataclass
class Results:
    """Every finished run by profile, tuning and report runs apart, and the step size chosen per method."""

    tuning: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    report: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    chosen: dict[str, dict[str, float | None]] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)


def _record(run: Run, timed: Timed) -> dict[str, Any]:
    r, took = timed
    out = asdict(r)
    out.update(method=run.method, lr=run.lr, cpu_s=took)
    return out


def run_study(mode: str, out_dir: str, jobs: int = 1, resume: bool = False, only: tuple[str, ...] = ()) -> int:
    """Tune every tuned profile, then run every profile's report seeds at the chosen step sizes; with `resume`,
    keep the runs of an earlier, interrupted run of the same study in the folder and run only the rest.

    With `only` (method names, "default" for `DEFAULT`), tune nothing: run those methods' report runs alone at
    the step sizes the folder's tuning runs chose (`resume`), else at those TUNED_LRS holds for the profile (the
    default at `lr_source`'s), into the same folder, so that they are tabled beside the study's other methods: a
    changed default is re-measured this way."""
    out = Path(out_dir) / mode
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    only = tuple(DEFAULT.name if m == "default" else m for m in only)
    unknown = [m for m in only if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from default, {', '.join(METHODS)}")
    profiles = tuple(replace(p, methods=tuple(dict.fromkeys((*p.methods, *only)))) for p in STUDIES[mode])
    res = Results(profiles={p.profile: asdict(p) for p in profiles})
    if (resume or only) and (out / "results.json").exists():  # `only` adds to a folder, never replaces it
        earlier = Results(**json.loads((out / "results.json").read_text()))
        res.tuning, res.report = earlier.tuning, earlier.report
    log = lambda s: print(s, flush=True)  # noqa: E731
    for p in profiles:  # one profile at a time, so that a study stopped early has whole tables
        if only and not p.lr_from:
            res.chosen[p.profile] = tuned_before(res, p) or dict(TUNED_LRS.get(p.profile, {}))
        elif not p.lr_from:
            res.chosen[p.profile] = tune(p, res, jobs, lambda: write(res, out, plots=False), log)
        chosen = res.chosen.setdefault(p.lr_from or p.profile, dict(TUNED_LRS.get(p.lr_from, {})))
        chosen.update({m: chosen.get(lr_source(METHODS[m])) for m in only})
        names = only or p.methods
        report = [Run(p, m, lr, s, False) for m in names if (lr := chosen.get(m)) is not None for s in p.seeds]
        for run, r in run_all([r for r in report if not _done(res, r)], jobs, log):
            res.report.setdefault(p.profile, []).append(_record(run, r))
            write(res, out, plots=False)
    write(res, out, plots=True)
    print(f"study {mode} done in {(time.monotonic() - started) / 60:.1f} min: {out / 'report.md'}", flush=True)
    print(f"default by measurement: {choose_default(res)}", flush=True)
    return 0


def tune(
    p: Profile,
    res: Results,
    jobs: int,
    save: Callable[[], None],
    log: Callable[[str], None],
) -> dict[str, float | None]:
    """Each method's step size on `p`: its grid on the tuning seeds, extended by twice its largest step size where
    that one won (half its smallest where that one won or every one diverged), up to `p.edge_steps` times, so that
    no choice is a grid's edge unless the study says so. A resumed study keeps the runs it has."""
    grids = {m: list(grid) for m in p.methods if (grid := p.grid(m))}
    for step in range(p.edge_steps + 1):
        plan = [Run(p, m, lr, s, True) for m, grid in grids.items() for lr in grid for s in p.tune_seeds]
        for run, r in run_all([r for r in plan if not _done(res, r)], jobs, log):
            res.tuning.setdefault(p.profile, []).append(_record(run, r))
            save()
        runs = [r for r in res.tuning.get(p.profile, []) if r["seed"] in p.tune_seeds]
        chosen = {m: choose_lr([r for r in runs if r["method"] == m and r["lr"] in grids[m]], p.target) for m in grids}
        edges = {m: past_edge(grids[m], lr) for m, lr in chosen.items()}
        if step == p.edge_steps or not any(edges.values()):
            break
        for m, lr in edges.items():
            if lr is not None:
                grids[m] = grown(grids[m], lr, p.refine)
    return with_sources(p, chosen)


def grown(grid: list[float], lr: float, refine: int) -> list[float]:
    """`grid` grown to `lr`, past one of its edges (`past_edge`), refined between that edge and `lr` as the profile
    refines its grids (`Profile.refine`), so that the grown part is as fine as the rest."""
    edge = grid[0] if lr < grid[0] else grid[-1]
    return sorted({*grid, *refined(tuple(sorted((lr, edge))), refine)})


def with_sources(p: Profile, chosen: dict[str, float | None]) -> dict[str, float | None]:
    """`chosen` with each of `p`'s methods that is not tuned itself (the default) at its `lr_source`'s step size."""
    return {m: chosen.get(m) if p.grid(m) else chosen.get(lr_source(METHODS[m])) for m in p.methods}


def tuned_before(res: Results, p: Profile) -> dict[str, float | None]:
    """Each method's step size by the tuning runs `res` holds for `p` (those of a resumed study), as `tune` chose
    it; empty where it holds none."""
    runs = [r for r in res.tuning.get(p.profile, []) if r["seed"] in p.tune_seeds]
    chosen = {m: choose_lr(rs, p.target) for m in p.methods if (rs := [r for r in runs if r["method"] == m])}
    return with_sources(p, chosen) if chosen else {}


def past_edge(grid: list[float], chosen: float | None) -> float | None:
    """The step size past the edge of `grid` that `chosen` sits on (None: inside it, nothing to add)."""
    if chosen is None or chosen == grid[0]:
        return grid[0] / 2
    return 2 * grid[-1] if chosen == grid[-1] else None


def _done(res: Results, run: Run) -> bool:
    """Whether `res` already holds `run` (a resumed study runs it again only if not)."""
    runs = (res.tuning if run.tuning else res.report).get(run.profile.profile, [])
    return any((r["method"], r["lr"], r["seed"]) == (run.method, run.lr, run.seed) for r in runs)


def method_rows(p: dict[str, Any], runs: list[dict[str, Any]], chosen: dict[str, float | None]) -> list[dict[str, Any]]:
    """Per method of a profile: its step size (its runs', else the one chosen for it), median time to the target and
    each seed's (`by_seed`, in seed order), how many runs got there and diverged."""
    rows = []
    for m in p["methods"]:
        rs = [r for r in runs if r["method"] == m and chosen.get(m) in (None, r["lr"])]
        if not rs:
            rows.append({"method": m, "lr": chosen.get(m), "runs": 0})
            continue
        accs = [r["final_test_acc"] for r in rs]
        rows.append(
            {
                "method": m,
                "lr": rs[0]["lr"],
                "runs": len(rs),
                "time": median_time(rs, p["target"]),
                "by_seed": [time_to(r, p["target"]) for r in sorted(rs, key=lambda r: r["seed"])],
                "reached": sum(1 for r in rs if time_to(r, p["target"]) != math.inf),
                "diverged": sum(1 for r in rs if diverged(r)),
                "acc": statistics.fmean(accs),
                "acc_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "sps": statistics.fmean(r["samples_per_s"] for r in rs),
                "stale": statistics.fmean(r["staleness_mean"] or 0.0 for r in rs),
            }
        )
    return rows


def choose_default(res: Results) -> str | None:
    """Among the methods run on every profile that never diverged in a report run (their step sizes never diverged
    in tuning: `choose_lr`), one that reaches the target on the most profiles, then the best median (over profiles)
    of its median time to the target: a median over profiles alone would name a method that never reaches the
    target on one cluster of four. Where those tie (as at "never", when the target was not reached on half the
    profiles), the one with the best median accuracy at the budget, not the first listed."""
    times: dict[str, list[float]] = {}
    accs: dict[str, list[float]] = {}
    for name, p in res.profiles.items():
        for row in method_rows(p, res.report.get(name, []), res.chosen.get(p["lr_from"] or name, {})):
            if row["runs"]:
                times.setdefault(row["method"], []).append(row["time"])
                accs.setdefault(row["method"], []).append(row["acc"])
    unstable = {r["method"] for runs in res.report.values() for r in runs if diverged(r)}
    stable = {m: ts for m, ts in times.items() if len(ts) == len(res.profiles) and m not in unstable}
    if not stable:
        return None
    return min(
        stable,
        key=lambda m: (
            sum(not math.isfinite(t) for t in stable[m]),
            statistics.median(stable[m]),
            -statistics.median(accs[m]),
        ),
    )


def reference_s(p: dict[str, Any]) -> float | None:
    """T* of a profile's cluster in virtual seconds (bench/reference_time.py), where its setting is the one K(B) was
    measured for."""
    if (p["model"], p["dataset"], p["target"]) != STUDY_SETTING:
        return None
    base = SimConfig("asgd", "fixed", ())
    return cluster_optimum(CLUSTERS[p["profile"]](), base.fixed_s * p["slower"], base.per_sample_s * p["slower"]).time_s


def render(res: Results) -> str:
    """Per profile: each method's tuned step size and figures, and each method's time against asgd+fixed's, the
    best method's and T*, the cluster's optimal time."""
    out = []
    for name, p in res.profiles.items():
        runs = res.report.get(name, [])
        if not runs:
            continue
        chosen = res.chosen.get(p["lr_from"] or name, {})
        n = len(CLUSTERS[p["profile"]]())
        tuned = (
            f"step sizes from {p['lr_from']}"
            if p["lr_from"]
            else f"each method's step size tuned over its grid on seeds {', '.join(map(str, p['tune_seeds']))}"
        )
        t_star = reference_s(p)
        m = (
            f"; msync's m = {msync_m(name)}"
            if any(x in METHODS and METHODS[x].protocol == "msync" for x in p["methods"])
            else ""
        )
        out += [
            f"### {name}: {n} workers, {p['model']}, B = {p['global_batch']}, {p['budget_s']:g} virtual s, "
            f"seeds {', '.join(map(str, p['seeds']))}; {tuned}"
            + ("" if t_star is None else f"; T* = {t_star:.1f} s")
            + m,
            "",
            f"| method | lr | time to {float(p['target']):.0%} (median) | reached | diverged (runs) "
            "| diverged in any seed | test acc. at budget | samples/s | staleness mean | time / asgd+fixed's "
            "| time / best | time / T* | by seed (s) |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        rows = method_rows(p, runs, chosen)
        base = next((r["time"] for r in rows if r["method"] == "asgd+fixed" and r["runs"]), math.inf)
        best = min((r["time"] for r in rows if r["runs"]), default=math.inf)
        for row in rows:
            if not row["runs"]:  # no step size to run at, or an interrupted study that had not run it yet
                why = "every step size diverged in tuning" if row["lr"] is None else f"not run (lr {row['lr']:g})"
                out.append(f"| {row['method']} | – | {why} | | | | | | | | | | |")
                continue
            t = "–" if row["time"] == math.inf else f"{row['time']:.0f} s"
            out.append(
                f"| {row['method']} | {row['lr']:g} | {t} | {row['reached']}/{row['runs']} | "
                f"{row['diverged']}/{row['runs']} | {'yes' if row['diverged'] else 'no'} | "
                f"{100 * row['acc']:.2f}% ± {100 * row['acc_sd']:.2f} | {row['sps']:,.0f} | "
                f"{row['stale']:.1f} | {_ratio(row['time'], base)} | {_ratio(row['time'], best)} | "
                f"{_ratio(row['time'], t_star or math.inf)} | "
                f"{', '.join('–' if s == math.inf else f'{s:g}' for s in row['by_seed'])} |"
            )
        out += ["", f"![{name}](plots/tuned_{name}.png)", "", cost_line(res.tuning.get(name, []), runs), ""]
        own = [r for r in res.tuning.get(name, []) if r["seed"] in p["tune_seeds"]]
        out += render_shared(name, own, p["target"], chosen)
    evidence = [
        evidence_row(name, file, method_rows(p, res.report[name], res.chosen.get(p["lr_from"] or name, {})))
        for name, p in res.profiles.items()
        if res.report.get(name) and (file := CLUSTER_FILES[name].file if name in CLUSTER_FILES else None)
    ]
    if evidence:
        out += [
            "### auto's pick on each cluster file (common/planning/auto_choice.py `choose`)",
            "",
            *render_evidence(evidence),
        ]
        out.append("")
    everything = [r for runs in (*res.tuning.values(), *res.report.values()) for r in runs]
    out += [
        f"The whole study: {_minutes(everything)} of CPU; `--jobs 2` takes about half that in wall time.",
        "",
        f"Default by measurement (never diverged, reaches the target on the most profiles, then the best median "
        f"time to target over them): "
        f"**{choose_default(res)}**",
        "",
    ]
    return "\n".join(out)


def _ratio(time_s: float, reference_s: float) -> str:
    """`time_s` against `reference_s`, or a dash where either is not known (never reached, no reference)."""
    return f"{time_s / reference_s:.2f}x" if math.isfinite(time_s) and math.isfinite(reference_s) else "–"


def _minutes(runs: list[dict[str, Any]]) -> str:
    timed = [r["cpu_s"] for r in runs if "cpu_s" in r]
    if not timed:
        return "not timed"
    missing = len(runs) - len(timed)
    untimed = f" ({missing} runs from before runs were timed not counted)" if missing else ""
    return f"{sum(timed) / 60:.0f} min{untimed}"


def cost_line(tuning: list[dict[str, Any]], report: list[dict[str, Any]]) -> str:
    """What a profile's runs cost, in CPU minutes: its tuning runs and its report runs apart."""
    tuned = f"{len(tuning)} tuning runs, {_minutes(tuning)}; " if tuning else ""
    return f"Cost (CPU minutes): {tuned}{len(report)} report runs, {_minutes(report)}."


def plot(runs: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Accuracy against virtual time, one colour per method (each at its tuned step size)."""
    from bench.plots import accuracy_axis, plt, save

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab10")
    colours = {m: cmap(i % 10) for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    labelled: set[str] = set()
    for r in runs:
        t, _, acc = zip(*r["curve"], strict=True)
        label = f"{r['method']} (lr {r['lr']:g})"
        ax.plot(
            t,
            [100 * a for a in acc],
            color=colours[r["method"]],
            alpha=0.7,
            linewidth=1.1,
            label=None if label in labelled else label,
        )
        labelled.add(label)
    accuracy_axis(ax, "virtual seconds since the first batch", (10, 92))
    return save(fig, [ax], title, path)


def write(res: Results, out: Path, plots: bool) -> None:
    """results.json and report.md (and the plots) from whatever runs are in, so an interrupted study still reports."""
    (out / "results.json").write_text(json.dumps(asdict(res)))
    (out / "report.md").write_text(render(res))
    if plots:
        for name, runs in res.report.items():
            plot(runs, f"simulated {name}: each method at its tuned step size", out / f"tuned_{name}.png")


if __name__ == "__main__":  # re-render DIR's report and plots from its results.json
    import sys

    folder = Path(sys.argv[1])
    write(Results(**json.loads((folder / "results.json").read_text())), folder, plots=True)
