"""A full disk under `--out`: one clear line, exit 2, no process and no temporary file left behind.

The run folder is put on a small tmpfs mounted for the test (root only: elsewhere the
test is skipped, and under CI it fails, since a skip would hide the case), and the disk
is filled by the test itself once the job trains, so the moment is the test's, not luck's.
"""

from __future__ import annotations

import errno
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynabatch.common.atomic_file import storage_error, write_text_atomic
from hang_guard import hang_guard_s
from harness import child_env, command_line
from run_process import FOREVER, RunProcess
from tools import missing

FULL = re.compile(r"no space left on device")


def _tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `mount` with `options`, unmounted (lazily, should something still hold it) whatever
    the test did."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        missing(
            f"mounting a tmpfs for the full-disk tests failed ({done.stderr.strip() or done.returncode}; it needs root)"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "disk", "size=16m")  # a running job keeps two checkpoints (a .prev) and a temp


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "ro", "size=1m,ro")


def fill(disk: Path) -> None:
    """Write a file on `disk` until the disk refuses a byte more."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    for size in (4096, 1):
        with open(disk / "filler", "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def test_an_atomic_write_on_a_full_disk_leaves_the_old_file_and_no_temporary_one(small_disk: Path) -> None:
    path = small_disk / "state.json"
    write_text_atomic(path, "old")
    fill(small_disk)
    with pytest.raises(OSError) as caught:
        write_text_atomic(path, "new" * 100_000)
    assert storage_error(caught.value) == f"no space left on device writing {path}"
    assert path.read_text() == "old"
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "state.json"]


def test_a_run_folder_on_a_full_disk_is_refused_before_start_and_none_is_left(small_disk: Path) -> None:
    fill(small_disk)
    done = subprocess.run(
        command_line("run", ["--out", str(small_disk), "--name", "r", *FOREVER]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        env=child_env(),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"dynabatch run: --out {small_disk}: cannot write the run folder {small_disk / 'r'}: No space left on device\n"
    )
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_run_folder_on_a_read_only_disk_is_refused_before_start(read_only_disk: Path) -> None:
    done = subprocess.run(
        command_line("run", ["--out", str(read_only_disk / "runs"), "--name", "r", *FOREVER]),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        env=child_env(),
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"dynabatch run: --out {read_only_disk / 'runs'}: cannot write the "
        f"run folder {read_only_disk / 'runs' / 'r'}: Read-only file system\n",
    )
    assert not any(read_only_disk.iterdir())


@pytest.mark.slow
def test_a_disk_that_fills_while_the_job_trains_ends_the_run_with_one_line_and_nothing_left(
    small_disk: Path, tmp_path: Path
) -> None:
    run = RunProcess(small_disk, tmp_path / "run.err", [*FOREVER, "--checkpoint-interval-s", "0.5"])
    try:
        run.trained_and_evaluated()
        fill(small_disk)
        rc, out, err = run.end()
        assert rc == 2, err
        assert "Traceback" not in err, err
        said = [line for line in err.splitlines() if FULL.search(line)]
        assert said and all(
            re.fullmatch(
                r"(\w+ exited with code 2, not restarted: (dynabatch \w+: )?|dynabatch run: )no space left on device.*",
                line,
            )
            for line in said
        ), err
        assert "starting it again" not in err, "a full disk is not a crash: no restart"
        assert not run.leftovers(0), "every child was stopped before the run exited"
        assert not run.temporary_files()
    finally:
        run.close()
