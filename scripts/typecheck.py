"""Run mypy on dynabatch as the package it installs as, then on bench/, examples/ and tests/.

pyproject.toml maps folders to packages (api/ is `dynabatch`, common/ is `dynabatch.common`, ...), and the
editable install resolves that mapping with an import hook, which mypy does not run. So this script lays the
package out as it is installed, in build/typecheck/dynabatch/, with links to the real folders and files, and
points mypy at it; mypy's findings are printed with the real paths (common/wire.py, not the link's path).
The settings, the strict modules included, are in pyproject.toml's [tool.mypy].
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
TOP = "dynabatch"
# Not packages but checked too: their imports of dynabatch resolve through TREE.
OTHER_PATHS = ("bench", "examples", "tests")


def package_dirs() -> dict[str, Path]:
    """Each package of the install and its folder, as [tool.setuptools.package-dir] declares them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


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


def real_paths(text: str, dirs: dict[str, Path]) -> str:
    """mypy's output with each linked path replaced by the file's place in the repository."""
    prefixes = sorted(((name.removeprefix(TOP).replace(".", "/"), folder) for name, folder in dirs.items()),
                      key=lambda item: -len(item[0]))
    lines = []
    for line in text.splitlines(keepends=True):
        for sub, folder in prefixes:
            linked = f"build/typecheck/{TOP}{sub}/"
            if line.startswith(linked):
                line = f"{folder.relative_to(ROOT)}/{line.removeprefix(linked)}"
                break
        lines.append(line)
    return "".join(lines)


def main() -> int:
    dirs = package_dirs()
    top = lay_out_tree(dirs)
    command = [sys.executable, "-m", "mypy", str(top.relative_to(ROOT)), *OTHER_PATHS]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    sys.stdout.write(real_paths(done.stdout, dirs))
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
