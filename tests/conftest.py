"""The suite's order: modules with end-to-end (`slow`) tests first, the quick ones after them.

pytest-xdist (`--dist loadscope`) hands whole modules to its test processes
in collection order, alphabetical by file. A long module drawn late kept one
process busy alone at the end: beside a second copy of the suite, the fuzz (over
a minute) started at 97% and was the last test of the run. Started first, the
long modules overlap each other, and the many quick modules fill the end. This order
holds only with `--no-loadscope-reorder` (pyproject.toml): pytest-xdist otherwise
hands out the modules with the most tests first, and beside a second copy the
single-test fuzz, sharding and ssp modules (50 s each there) were again the run's last.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hang_guard import within_test_limit

pytest_plugins = ("cpu_durations",)  # `--cpu-durations N`: the tests that cost the suite the most CPU


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module(item) not in slow_modules)  # stable: files in order within each part


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Each test's timeout, a hang guard, scaled by the load the test starts under (`hang_guard`), and set before
    pytest-timeout reads it: the test's own timeout marker, or pytest-timeout's setting (`--timeout`,
    PYTEST_TIMEOUT, pyproject.toml; 0 is none). The guards the test sets end by then."""
    if item.config.pluginmanager.hasplugin("timeout"):
        from pytest_timeout import get_env_settings

        own = item.get_closest_marker("timeout")
        alone_s = float(own.args[0]) if own is not None and own.args else get_env_settings(item.config).timeout
        if alone_s:
            with within_test_limit(alone_s) as limit_s:
                item.add_marker(pytest.mark.timeout(limit_s), append=False)
                yield
            return
    yield


@pytest.fixture(autouse=True, scope="session")
def _one_preloader_per_test_process() -> Iterator[None]:
    """Every job of this test process forks its roles from one preloader (harness.shared_preloader)."""
    from harness import shared_preloader  # torch's import: not in pytest-xdist's controller, which runs no test

    with shared_preloader():
        yield
