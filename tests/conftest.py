"""Test order: the longest modules first.

The suite runs in two processes that take whole modules (`--dist loadscope`) in
collection order. A long module handed out last keeps one process busy while the
other idles (the last 5% of the tests took over two minutes of a 14-minute run);
handed out first, the short modules fill in beside it. The list is the modules
with the longest tests as `--durations` reports them, longest first.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = ("test_run", "test_membership", "test_fuzz", "test_faults", "test_acceptance_task", "test_ssp",
                 "test_prometheus", "test_examples", "test_sharding")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.module.__name__.rpartition(".")[2]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the other modules, and each module's tests, keep their order
