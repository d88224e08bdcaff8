"""Independent simulations run side by side in processes, yielded as each finishes, with a progress line."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(
    simulate: Callable[[T], tuple[T, R]],
    plan: list[T],
    jobs: int,
    describe: Callable[[T, R], str],
    log: Callable[[str], None],
) -> Iterator[tuple[T, R]]:
    """Every item of `plan` through `simulate` (a module-level function: the pool spawns its processes) in `jobs`
    processes (1: this one), yielded as each finishes, each logged as `[i/n] describe(item, result)` with the time
    elapsed and an estimate of what is left. Runs are functions of their own settings, so running them side by
    side changes only the order they finish in."""
    started = time.monotonic()
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None
    finished: Iterator[tuple[T, R]] = (
        map(simulate, plan)
        if pool is None
        else (f.result() for f in as_completed([pool.submit(simulate, item) for item in plan]))
    )
    try:
        for i, (item, r) in enumerate(finished, 1):
            took = time.monotonic() - started
            log(
                f"[{i}/{len(plan)}] {describe(item, r)} "
                f"(elapsed {took / 60:.1f} min, about {took / i * (len(plan) - i) / 60:.1f} left)"
            )
            yield item, r
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
