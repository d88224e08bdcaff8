"""`make lint`: ruff, then mypy, with the settings in pyproject.toml; exits non-zero on any new finding.

mypy: pyproject.toml maps folders to packages (api/ is `dynabatch`, common/ is `dynabatch.common`, ...), and the
editable install resolves that mapping with an import hook, which mypy does not run. So the package is laid out as
it is installed, in build/typecheck/dynabatch/, with links to the real folders and files, and mypy is pointed at it
and at bench/, examples/, scripts/ and tests/; its findings are printed with the real paths (common/wire.py, not the
link's).

Known findings not yet fixed are listed in pyproject.toml's [tool.dynabatch.lint-debt] by file and code (the files
other work was changing when the tools came in). They are left out of what is printed and judged, and counted;
`--all` prints them too. Plain `ruff check` and `ruff check --fix` see every finding.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
TOP = "dynabatch"
# Not packages but checked too: their imports of dynabatch resolve through TREE.
OTHER_PATHS = ("bench", "examples", "scripts", "tests")
RUFF_FINDING = re.compile(r"^(?P<path>[^:\s]+):\d+:\d+: (?P<code>[A-Z]+[0-9]+) ")
MYPY_FINDING = re.compile(r"^(?P<path>[^:\s]+):(?:\d+:)? (?P<kind>error|note): .*?(?:  \[(?P<code>[a-z-]+)\])?$")


def package_dirs(project: dict) -> dict[str, Path]:
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


SUMMARY = re.compile(r"^(Found \d+ errors?|All checks passed|\[\*\] \d+ fixable|No fixes available|Success: no issues"
                     r"|\d+ unsafe fixes? available)")


def sift(lines: list[str], finding: re.Pattern[str], debt: dict[str, list[str]],
         ) -> tuple[list[str], list[str], Counter[str]]:
    """(new findings and anything else the tool said, known findings, known ones by file).

    A note stays with the finding above it; the tools' own summaries are dropped (the counts are this script's).
    """
    new: list[str] = []
    known: list[str] = []
    by_file: Counter[str] = Counter()
    into = new
    for line in lines:
        match = finding.match(line)
        if match is None:
            if line.strip() and not SUMMARY.match(line):
                new.append(line)  # the tool's own trouble (a bad setting, a file it cannot read): shown, and fails
            continue
        if match.groupdict().get("kind") != "note":
            into = known if match["code"] in debt.get(match["path"], ()) else new
            if into is known:
                by_file[match["path"]] += 1
        into.append(line)
    return new, known, by_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="print the known findings too")
    show_all = parser.parse_args().all
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    debt = project["tool"].get("dynabatch", {}).get("lint-debt", {})
    failed = False
    for tool, finding in (("ruff", RUFF_FINDING), ("mypy", MYPY_FINDING)):
        if tool == "ruff":
            code, lines = run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."])
        else:
            dirs = package_dirs(project)
            top = lay_out_tree(dirs)
            code, lines = run([sys.executable, "-m", "mypy", str(top.relative_to(ROOT)), *OTHER_PATHS])
            lines = [real_path(line, dirs) for line in lines]
        new, known, by_file = sift(lines, finding, debt.get(tool, {}))
        for line in new + (known if show_all else []):
            print(line)
        errors = sum(1 for line in new if ": note: " not in line)
        if code != 0 and not new and not by_file:
            print(f"{tool}: exited {code} without a finding (what it said is above)")
            failed = True
            continue
        failed |= errors > 0
        print(f"{tool}: {errors} new finding(s); {sum(by_file.values())} known in {len(by_file)} file(s) "
              f"([tool.dynabatch.lint-debt.{tool}] in pyproject.toml)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
