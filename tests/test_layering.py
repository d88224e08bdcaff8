"""The code is layered: roles meet only on the wire, and what is cheap never loads torch.

ps/, worker/ and scheduler/ import the public API (api/, `dynabatch`) and common/, never
each other, nor the launcher (cluster/) or the command (cli/); api/ and common/ import no
role at all. The api/ folder's rule for the launcher: `db.run` and `db.export` are
cluster's, so api/ names them only in its table of lazily loaded names, never in an
import, and nothing a user's task file imports from `dynabatch` loads a role or cluster/.
These are read from the source (every import statement, wherever it sits).

torch takes seconds to import. `dynabatch keys` only writes four files, and the job
schema is read by every command before it can refuse a bad flag, so neither may
pull in the dataset loaders or the models. Each such check runs a fresh interpreter,
whose modules are exactly what the code under test imported.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynabatch.common.net.curve import KEY_FILES
from dynabatch.common.tasks.dataset_files import IDX_FILES
from hang_guard import hang_guard_s

# CPU time of a whole `dynabatch keys` run: about 0.1 s here; importing torch alone takes 2 s.
KEYS_CPU_BUDGET_S = 0.5
# "import time:  self [us] | cumulative | name", the name indented two spaces per level.
IMPORTTIME_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")
HEAVY = ("torch", "dynabatch.common.tasks.data", "dynabatch.common.tasks.models")
ROLES = ("dynabatch.ps", "dynabatch.worker", "dynabatch.scheduler", "dynabatch.cluster")
REPO = Path(__file__).resolve().parents[1]
# Each folder and the package it installs as (pyproject.toml's package-dir).
PACKAGES = {
    "api": "dynabatch",
    "common": "dynabatch.common",
    "ps": "dynabatch.ps",
    "worker": "dynabatch.worker",
    "scheduler": "dynabatch.scheduler",
    "cluster": "dynabatch.cluster",
    "cli": "dynabatch.cli",
}
WIRE_ROLES = ("ps", "worker", "scheduler")  # the processes of a job: they meet only on the wire
NOT_BELOW_A_ROLE = ("dynabatch.ps", "dynabatch.worker", "dynabatch.scheduler", "dynabatch.cluster", "dynabatch.cli")


def _is_under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _outermost(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """Those of `modules` under `packages`, without the submodules of one listed (torch, not its 1000 parts)."""
    hits = {m for m in modules if _is_under(m, packages)}
    return sorted(m for m in hits if not any(m.startswith(h + ".") for h in hits))


def _static_imports(folder: str) -> dict[str, set[str]]:
    """File -> every dynabatch module its import statements name (`from dynabatch import optim` names
    dynabatch.optim), read from the source of each file in `folder`, imports inside functions included."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / folder).glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: a relative import; name the module (dynabatch.x.y)"
                names.add(node.module or "")
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[f"{folder}/{path.name}"] = {n for n in names if _is_under(n, ("dynabatch",))}
    return found


def test_no_role_imports_another_nor_the_launcher() -> None:
    offending = []
    for role in WIRE_ROLES:
        others = tuple(p for p in NOT_BELOW_A_ROLE if p != PACKAGES[role])
        for file, modules in _static_imports(role).items():
            offending += [f"{file} imports {m}" for m in sorted(modules) if _is_under(m, others)]
    assert not offending, offending


@pytest.mark.parametrize("folder", ["api", "common"])
def test_the_public_api_and_common_import_no_role(folder: str) -> None:
    offending = [
        f"{file} imports {m}"
        for file, modules in _static_imports(folder).items()
        for m in sorted(modules)
        if _is_under(m, NOT_BELOW_A_ROLE)
    ]
    assert not offending, offending


def test_the_public_api_names_only_the_launcher_and_only_for_lazy_names() -> None:
    """`db.run` and `db.export` are the launcher's (cluster/): api/ may name them in its table of lazily
    loaded names, as strings, and nothing of ps, worker, scheduler or cli anywhere."""
    import dynabatch

    lazy = {module for module, _ in dynabatch._NAMES.values()}
    assert not [m for m in lazy if _is_under(m, NOT_BELOW_A_ROLE) and not _is_under(m, ("dynabatch.cluster",))]
    for path in (REPO / "api").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value not in lazy:
                named = re.findall(r"\bdynabatch\.(?:ps|worker|scheduler|cluster|cli)\.\w+", node.value)
                assert not named, f"api/{path.name} names {named} outside the lazy table"


def test_the_public_names_are_the_lazy_table() -> None:
    """`__all__` is a literal (tools read it without importing): it names each lazily loaded name, once,
    and no other."""
    import dynabatch

    assert sorted(dynabatch.__all__) == sorted(dynabatch._NAMES)


def test_what_a_task_file_imports_from_dynabatch_loads_no_role() -> None:
    public = ("Task", "TaskError", "optim", "schedule", "metrics")
    loaded = _outermost(
        _imported_by("import dynabatch as db\n" + "\n".join(f"db.{n}" for n in public)), NOT_BELOW_A_ROLE
    )
    assert not loaded, f"the public API's task-side names loaded {loaded}"


@pytest.mark.parametrize("module", ["dynabatch.optim", "dynabatch.schedule", "dynabatch.task_error"])
def test_the_task_specs_load_no_torch(module: str) -> None:
    """A flag error or a built-in job's check names an optimizer, a schedule or a TaskError without torch."""
    loaded = _outermost(_imported_by(f"import {module}"), HEAVY)
    assert not loaded, f"{module} imported {loaded}"


def _help_sections(text: str) -> dict[str, list[str]]:
    """pydoc's plain text, as section title -> the names it lists (classes, functions, package contents)."""
    sections: dict[str, list[str]] = {}
    title = ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            title = line.strip()
            sections[title] = []
        elif title in ("CLASSES", "FUNCTIONS", "PACKAGE CONTENTS", "DATA"):
            entry = re.match(r"^    (?:class )?([A-Za-z_]\w*)(?:\(| = |$)", line)
            if entry:
                sections[title].append(entry.group(1))
    return sections


def test_help_of_dynabatch_lists_exactly_the_public_names() -> None:
    """`help(dynabatch)` is the promise to users: it lists every public name, in its docstring and as an
    entry, and no internal one (the lazily loaded names' own imports, submodules of dynabatch.common)."""
    code = "import pydoc, dynabatch\nprint(pydoc.render_doc(dynabatch, renderer=pydoc.plaintext))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_guard_s(120))
    assert out.returncode == 0, out.stderr
    import dynabatch

    public = set(dynabatch.__all__)
    assert {"Task", "TaskError", "optim", "schedule", "metrics", "run", "Run", "export"} <= public
    assert set(dir(dynabatch)) == public
    assert not [n for n in public if f"`{n}`" not in (dynabatch.__doc__ or "")], "the docstring lists every name"
    sections = _help_sections(out.stdout)
    listed = [n for title in ("CLASSES", "FUNCTIONS", "DATA") for n in sections.get(title, [])]
    modules = set(sections.get("PACKAGE CONTENTS", []))
    assert not [n for n in listed if n not in public], f"help(dynabatch) lists internal names: {listed}"
    assert public == set(listed) | (modules & public), f"help(dynabatch) misses {public - set(listed) - modules}"


def _imported_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement`."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_guard_s(60))
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


def test_keys_command_imports_neither_torch_nor_the_job_schema(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dynabatch.cli.main", "keys", "--out", str(tmp_path / "keys")],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(tmp_path / "keys")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr and proc.stderr.read()
    cpu_s = usage.ru_utime + usage.ru_stime
    assert cpu_s < KEYS_CPU_BUDGET_S, f"`dynabatch keys` used {cpu_s:.2f} s of CPU"


def test_job_schema_loads_no_torch_nor_the_data_and_model_registries() -> None:
    loaded = _outermost(_imported_by("import dynabatch.common.config"), HEAVY)
    assert not loaded, f"dynabatch.common.config imported {loaded}"


@pytest.mark.parametrize(
    "module", ["dynabatch.common.net.curve", "dynabatch.common.net.transport", "dynabatch.common.wire.frames"]
)
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
        "prepare(opts, job)"
    )
    loaded = _outermost(modules, HEAVY)
    assert not loaded, f"`dynabatch run` imported {loaded} to check a built-in job"
    assert len(list(tmp_path.glob("*/config.json"))) == 1, "the check passed and the run folder was made"


@pytest.mark.parametrize("command", ["ps", "worker"])
@pytest.mark.parametrize(
    "flags", [["--help"], ["--scheduler", "tcp://127.0.0.1:5555", "--no-such-flag"]], ids=["help", "bad-flag"]
)
def test_a_shard_or_worker_answers_help_and_refuses_a_flag_without_torch(command: str, flags: list[str]) -> None:
    """What a user types wrong, or `--help`, is answered before the role's code loads torch (1.5 s of CPU)."""
    modules = _imported_by(
        "import contextlib, os\nfrom dynabatch.cli.main import main\n"
        "with open(os.devnull, 'w') as null, contextlib.redirect_stdout(null):\n"
        f"    try:\n        main({[command, *flags]!r})\n    except SystemExit:\n        pass"
    )
    assert f"dynabatch.{command}.main" in modules, "the command ran"
    loaded = _outermost(modules, HEAVY)
    assert not loaded, f"`dynabatch {command} {' '.join(flags)}` imported {loaded}"
