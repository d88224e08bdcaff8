"""A missing external tool, or missing Fashion-MNIST, skips a test on a developer's machine and fails it under CI
(tests/tools.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hang_guard import hang_guard_s
from tools import find_tool

TESTS = Path(__file__).resolve().parent
NEEDS_A_MISSING_TOOL = """
from pathlib import Path

import tools
from tools import need_fashion_mnist, need_module, need_tool

def test_tool():
    need_tool("dynabatch-no-such-tool", "there is none")

def test_module():
    need_module("dynabatch_no_such_module", "there is none")

def test_data(monkeypatch):
    monkeypatch.setattr(tools, "FASHION_MNIST", Path("/nonexistent/fashion-mnist"))
    need_fashion_mnist()
"""


def _pytest_outcome(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "test_needs.py").write_text(NEEDS_A_MISSING_TOOL)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rsf",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_needs.py"),
        ],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        cwd=tmp_path,
        env=env,
    )
    return out.stdout


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_missing_tool_skips_outside_ci(tmp_path: Path, ci: str | None) -> None:
    report = _pytest_outcome(tmp_path, ci)
    assert "3 skipped" in report and "failed" not in report, report
    assert "dynabatch-no-such-tool is not installed (there is none)" in report
    assert "Fashion-MNIST is not in /nonexistent/fashion-mnist" in report


@pytest.mark.parametrize("ci", ["true", "1"])
def test_missing_tool_fails_under_ci_naming_it(tmp_path: Path, ci: str) -> None:
    report = _pytest_outcome(tmp_path, ci)
    assert "3 failed" in report and "skipped" not in report, report
    assert "dynabatch-no-such-tool is not installed" in report
    assert "dynabatch_no_such_module is not installed" in report
    assert "Fashion-MNIST is not in /nonexistent/fashion-mnist" in report


def test_finds_the_tools_of_this_interpreters_environment_before_path() -> None:
    """The test extra's kubectl lies next to this interpreter: found there even when PATH has another."""
    assert find_tool("dynabatch-no-such-tool") is None
    python = find_tool(Path(sys.executable).name)
    assert python is not None
    assert Path(python).parent in {Path(sysconfig.get_path("scripts")), Path(sys.executable).parent}
