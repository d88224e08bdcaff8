"""Slow links in the virtual-time cluster: the dynamic split with equal steps against compute shares.

links16 (bench/simulate.py): 16 equally fast nodes, 4 behind links 10 times slower, with the paper study's
timings (bench/simulate_study.py, `slower=10`: a 1x node's step 0.04 + 0.005*b virtual s, a pull or a push
0.02 s, 0.2 s behind a slow link) and its MLP settings (B = 512, lr 0.02, no momentum). For each protocol it runs
the dynamic policy twice, with the split the protocol's own objective picks and with the other one forced
(`SimConfig.equal_steps`), and the fixed policy, on the same seeds, and prints samples/s, time to 80% and 85%, and
the slow-link workers' share of the samples and mean batch. Run from the repository root:

    python -m bench.simulate_links [--protocols asgd softsync] [--seeds 0 1] [--budget-s 60]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from bench.simulate import PROFILES, SimResult, simulate
from bench.simulate_study import Part, sim_config
from dynabatch.common.protocols import protocol_spec
from dynabatch.common.tasks.data import load_dataset

PROFILE = "links16"


def slow_link_instances() -> set[str]:
    """The instances ("sim<i>") of the profile's nodes behind a slower link."""
    return {f"sim{i}" for i, spec in enumerate(PROFILES[PROFILE]()) if spec.link > 1}


def slow_share(result: SimResult) -> tuple[float, float]:
    """The slow-link workers' share of the samples, and their mean batch at the end."""
    slow = slow_link_instances()
    total = sum(result.worker_samples.values())
    share = sum(n for w, n in result.worker_samples.items() if w in slow) / max(1, total)
    return share, statistics.fmean(result.worker_batches[w] for w in slow)


def label(equal_steps: bool | None) -> str:
    return {None: "fixed", True: "dynamic, equal steps", False: "dynamic, compute shares"}[equal_steps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.simulate_links", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--protocols", nargs="+", default=["asgd"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--budget-s", type=float, default=60.0, help="virtual seconds")
    args = p.parse_args(argv)
    part = Part(
        PROFILE,
        PROFILE,
        512,
        "mlp",
        (),
        tuple(args.seeds),
        args.budget_s,
        2.0,
        1000,
        lr=0.02,
        momentum=0.0,
        slower=10.0,
    )
    data = load_dataset(part.dataset)
    print(
        "| protocol | split | samples/s | to 80% (s) | to 85% (s) | final acc | slow links' share | "
        "slow links' batch | staleness mean |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for protocol in args.protocols:
        own = protocol_spec(protocol).equal_steps
        for equal_steps in (None, not own, own):
            policy = "fixed" if equal_steps is None else "dynamic"
            runs = [
                simulate(replace(sim_config(part, seed, protocol, policy), equal_steps=equal_steps), data)
                for seed in args.seeds
            ]
            shares = [slow_share(r) for r in runs]
            times = {m: [r.time_to[m] for r in runs] for m in ("0.80", "0.85")}
            shown = {m: "/".join("-" if t is None else f"{t:.0f}" for t in ts) for m, ts in times.items()}
            stale = [r.staleness_mean for r in runs if r.staleness_mean is not None]
            print(
                f"| {protocol} | {label(equal_steps)}{' (its own)' if equal_steps == own else ''} | "
                f"{statistics.fmean(r.samples_per_s for r in runs):.0f} | {shown['0.80']} | {shown['0.85']} | "
                f"{100 * statistics.fmean(r.final_test_acc for r in runs):.1f}% | "
                f"{100 * statistics.fmean(s for s, _ in shares):.1f}% | {statistics.fmean(b for _, b in shares):.0f} "
                f"| {statistics.fmean(stale):.1f} |"
                if stale
                else "| - |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
