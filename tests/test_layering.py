"""common/ is layered: making keys, reading a job's settings and scheduling never load torch.

torch takes seconds to import. `dynabatch keys` only writes four files, and the job
schema is read by every command before it can refuse a bad flag, so neither may
pull in the dataset loaders or the models. Each check runs a fresh interpreter,
whose modules are exactly what the code under test imported.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynabatch.common.curve import KEY_FILES
from dynabatch.common.dataset_files import IDX_FILES

# CPU time of a whole `dynabatch keys` run: about 0.1 s here; importing torch alone takes 2 s.
KEYS_CPU_BUDGET_S = 0.5
# "import time:  self [us] | cumulative | name", the name indented two spaces per level.
IMPORTTIME_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")
HEAVY = ("torch", "dynabatch.common.data", "dynabatch.common.models")
ROLES = ("dynabatch.ps", "dynabatch.worker", "dynabatch.scheduler", "dynabatch.cluster")


def _is_under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _outermost(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """Those of `modules` under `packages`, without the submodules of one listed (torch, not its 1000 parts)."""
    hits = {m for m in modules if _is_under(m, packages)}
    return sorted(m for m in hits if not any(m.startswith(h + ".") for h in hits))


def _imported_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement`."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


def test_keys_command_imports_neither_torch_nor_the_job_schema(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dynabatch.cli.main", "keys", "--out", str(tmp_path / "keys")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == sorted(KEY_FILES)
    rows = [m.groups() for m in map(IMPORTTIME_LINE.match, out.stderr.splitlines()) if m]
    assert rows, f"no -X importtime output:\n{out.stderr}"
    # The command's own module, loaded by importlib.import_module, is not listed
    # (-X importtime sees only import statements), but everything it imports is.
    modules = {name for _, _, _, name in rows}
    loaded = _outermost(modules, HEAVY + ROLES + ("dynabatch.common.config",))
    assert not loaded, f"`dynabatch keys` imported {loaded}"


def test_keys_command_costs_under_half_a_second_of_cpu(tmp_path: Path) -> None:
    """The whole `dynabatch keys` run, interpreter start-up included, in CPU seconds: what it costs
    wherever it runs, and unlike wall time or -X importtime's clock not stretched by a busy machine."""
    proc = subprocess.Popen([sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(tmp_path / "keys")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr and proc.stderr.read()
    cpu_s = usage.ru_utime + usage.ru_stime
    assert cpu_s < KEYS_CPU_BUDGET_S, f"`dynabatch keys` used {cpu_s:.2f} s of CPU"


def test_job_schema_loads_no_torch_nor_the_data_and_model_registries() -> None:
    loaded = _outermost(_imported_by("import dynabatch.common.config"), HEAVY)
    assert not loaded, f"dynabatch.common.config imported {loaded}"


@pytest.mark.parametrize("module", ["dynabatch.common.curve", "dynabatch.common.transport", "dynabatch.common.wire"])
def test_keys_and_transport_do_not_depend_on_the_job_schema(module: str) -> None:
    modules = _imported_by(f"import {module}")
    assert "dynabatch.common.config" not in modules


def test_the_cli_imports_no_command_until_one_runs() -> None:
    loaded = _outermost(_imported_by("import dynabatch.cli.main"), HEAVY + ROLES)
    assert not loaded, f"dynabatch.cli.main imported {loaded}"


def test_the_scheduler_never_loads_torch() -> None:
    """It routes envelopes and sizes batches; holding no tensor, it should not pay torch's
    seconds of start-up and hundreds of MB on whatever small node runs it."""
    loaded = _outermost(_imported_by("import dynabatch.scheduler.main"), HEAVY)
    assert not loaded, f"dynabatch.scheduler.main imported {loaded}"


def test_dynabatch_run_checks_a_built_in_job_without_torch(tmp_path: Path) -> None:
    """The `dynabatch run` parent starts and follows processes; for a built-in job its check is that the
    dataset's files are there and their headers decode, so it does not pay torch's seconds (a user's task
    or --init weights do)."""
    data = tmp_path / "data"
    data.mkdir()
    for stem in IDX_FILES:  # one 28x28 image and its label per split, in the idx format
        dims = (1, 28, 28) if "images" in stem else (1,)
        header = bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
        (data / stem).write_bytes(header + bytes(math.prod(dims)))
    modules = _imported_by(
        "from dynabatch.cluster.main import parse, prepare\n"
        f"opts, job, _, _ = parse(['--dataset', 'fashion-mnist', '--data-dir', {str(data)!r}, "
        f"'--out', {str(tmp_path)!r}])\n"
        "prepare(opts, job)")
    loaded = _outermost(modules, HEAVY)
    assert not loaded, f"`dynabatch run` imported {loaded} to check a built-in job"
    assert len(list(tmp_path.glob("*/config.json"))) == 1, "the check passed and the run folder was made"
