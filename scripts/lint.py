"""`make lint`: ruff's checks, ruff's formatter (checked, not applied), then mypy, with the settings in
pyproject.toml; exits non-zero on any finding. `ruff format .` applies the formatter.

mypy: pyproject.toml maps folders to packages (api/ is `dynabatch`, common/ is `dynabatch.common`, ...), and the
editable install resolves that mapping with an import hook, which mypy does not run. So the package is laid out as
it is installed, in build/typecheck/dynabatch/, with links to the real folders and files, and mypy is pointed at it
and at bench/, examples/, scripts/ and tests/; its findings are printed with the real paths
(common/wire/frames.py, not the link's).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
TOP = "dynabatch"
# Not packages but checked too: their imports of dynabatch resolve through TREE.
OTHER_PATHS = ("bench", "examples", "scripts", "tests")


def package_dirs(project: dict[str, Any]) -> dict[str, Path]:
    """Each package of the install and its folder, as [tool.setuptools.package-dir] declares them."""
    return {name: ROOT / folder for name, folder in project["tool"]["setuptools"]["package-dir"].items()}


def lay_out_tree(dirs: dict[str, Path]) -> Path:
    """build/typecheck/dynabatch: the top package's own entries and each subpackage, as links; remade each run."""
    top = TREE / TOP
    if top.exists():
        for entry in top.iterdir():
            entry.unlink()
    top.mkdir(parents=True, exist_ok=True)
    for entry in dirs[TOP].iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name != TOP:
            (top / name.removeprefix(TOP + ".")).symlink_to(folder, target_is_directory=True)
    return top


def real_path(line: str, dirs: dict[str, Path]) -> str:
    """mypy's line with a linked path replaced by the file's place in the repository."""
    for name, folder in sorted(dirs.items(), key=lambda item: -len(item[0])):
        linked = f"build/typecheck/{name.replace('.', '/')}/"
        if line.startswith(linked):
            return f"{folder.relative_to(ROOT)}/{line.removeprefix(linked)}"
    return line


def run(command: list[str]) -> tuple[int, list[str]]:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    sys.stderr.write(done.stderr)
    return done.returncode, done.stdout.splitlines()


def main() -> int:
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0]).parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    failed = False
    code, lines = run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."])
    print(*lines, sep="\n")
    failed |= code != 0
    code, lines = run([sys.executable, "-m", "ruff", "format", "--check", "."])
    if code != 0:
        print(*lines, sep="\n")
        print("run `.venv/bin/ruff format .` to format these files")
    failed |= code != 0
    dirs = package_dirs(project)
    top = lay_out_tree(dirs)
    code, lines = run([sys.executable, "-m", "mypy", str(top.relative_to(ROOT)), *OTHER_PATHS])
    print(*(real_path(line, dirs) for line in lines), sep="\n")
    failed |= code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
