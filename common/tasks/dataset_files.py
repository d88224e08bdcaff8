"""Where a built-in dataset's files are: found on disk, or fetched once into the cache.

Kept free of torch so that `dynabatch run` can check a built-in job's data
before it starts anything, without paying torch's import (seconds of CPU) in a
process that never trains.
"""

from __future__ import annotations

import math
import mmap
import os
import tarfile
import time
import urllib.request
from pathlib import Path

from dynabatch.common.tasks.inflated_cache import inflated

# Module constants rather than literals so that tests (and odd installs) can move them.
SYSTEM_DIR = Path("/usr/share/datasets")
CACHE_DIR = Path.home() / ".cache" / "dynabatch"
DOWNLOAD_TIMEOUT_S = 5.0  # per connect and per read: a dead network fails fast
_DOWNLOAD_DEADLINE_S = 600.0  # whole transfer: a trickling server must not hold us forever

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
# Folders that common tools (Debian, torchvision, hand unpacking) use under a root. The
# first is ours: where the dataset lives under SYSTEM_DIR and CACHE_DIR.
_SUBDIRS = {
    "mnist": ("mnist", "MNIST/raw"),
    "fashion-mnist": ("fashion-mnist", "FashionMNIST/raw"),
    "cifar10": ("cifar10/cifar-10-batches-py", "cifar-10-batches-py"),
}
_URLS = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
}
_DEBIAN_PACKAGES = {"fashion-mnist": "dataset-fashion-mnist"}


class DatasetNotFound(FileNotFoundError):
    """A dataset's files are nowhere we look and could not be downloaded."""


class BadDatasetFile(ValueError):
    """A dataset's file is there but does not decode: truncated, corrupt, or of another format."""


def idx_content(path: Path) -> tuple[bytes | mmap.mmap, list[int], int]:
    """The bytes of one uint8 idx file (plain or .gz, inflated through the host's cache), its declared
    dimensions and where its data starts.

    The header is checked against the file's length so that a truncated download
    fails here, naming the file, instead of surfacing later as a shape error.
    """
    try:
        raw = inflated(path, CACHE_DIR / "inflated") if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise BadDatasetFile(f"{path}: unreadable idx file ({e})") from e
    if len(raw) < 4 or raw[0:2] != b"\0\0" or raw[2] != 0x08:
        raise BadDatasetFile(f"{path}: not a uint8 idx file (bad magic number {raw[:4].hex()})")
    ndim, start = raw[3], 4 + 4 * raw[3]
    if ndim == 0 or len(raw) < start:
        raise BadDatasetFile(f"{path}: idx header is truncated or has 0 dimensions")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    count = math.prod(dims)
    if len(raw) - start != count:
        raise BadDatasetFile(
            f"{path}: header declares {dims} = {count} bytes of data, "
            f"file holds {len(raw) - start}; truncated or corrupt"
        )
    return raw, dims, start


def check_images_and_labels(folder: Path, stem: str, images: list[int], labels: list[int]) -> None:
    """One split's images [N, H, W] and labels [N] agree; BadDatasetFile if not."""
    if len(images) != 3 or len(labels) != 1 or images[0] != labels[0]:
        raise BadDatasetFile(f"{folder}: {stem} images {images} do not match labels {labels}")


def check_dataset_files(name: str, folder: Path) -> None:
    """Decode the headers of every idx file of `name` in `folder` (found by `find_dataset`), without torch:
    what a worker would fail on at its start, found before any process starts. CIFAR's batches are
    pickles, read only by the loader."""
    if name == "cifar10":
        return
    dims = {stem: idx_content(idx_file(folder, stem) or folder / stem)[1] for stem in IDX_FILES}
    for split in ("train", "t10k"):
        check_images_and_labels(folder, split, dims[f"{split}-images-idx3-ubyte"], dims[f"{split}-labels-idx1-ubyte"])


def idx_file(folder: Path, stem: str) -> Path | None:
    """`stem` in `folder`, plain or gzipped; None if neither is there."""
    for path in (folder / stem, folder / f"{stem}.gz"):
        if path.is_file():
            return path
    return None


def _holds(name: str, folder: Path) -> bool:
    if name == "cifar10":
        return all((folder / f).is_file() for f in CIFAR_FILES)
    return all(idx_file(folder, stem) for stem in IDX_FILES)


def _candidates(name: str, data_dir: str | None) -> list[Path]:
    """Every folder we look in, in order: data_dir, $DYNABATCH_DATA_DIR, system, cache.

    A user's folder may hold the files itself or in a usual subfolder; our own
    folders hold them only in the dataset's home (e.g. /usr/share/datasets/mnist).
    """
    out: list[Path] = []
    for root in (data_dir, os.environ.get("DYNABATCH_DATA_DIR")):
        if root:
            root_path = Path(root).expanduser()
            out += [root_path] + [root_path / sub for sub in _SUBDIRS[name]]
    return out + [SYSTEM_DIR / _SUBDIRS[name][0], CACHE_DIR / _SUBDIRS[name][0]]


def _fetch(url: str, dest: Path, min_bytes: int) -> None:
    """Download url to dest via a .part file, so a broken transfer never looks like data."""
    part = dest.with_name(dest.name + ".part")
    deadline = time.monotonic() + _DOWNLOAD_DEADLINE_S
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp, open(part, "wb") as f:
            expected = int(resp.headers.get("Content-Length") or 0)
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url}: download took over {_DOWNLOAD_DEADLINE_S:.0f} s")
        size = part.stat().st_size
        if size < min_bytes or (expected and size != expected):
            raise OSError(f"{url}: got {size} bytes, expected {expected or f'>= {min_bytes}'}")
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)


def _download(name: str) -> Path:
    """Fetch a dataset into its cache home from the canonical source (OSError, TarError)."""
    folder = CACHE_DIR / _SUBDIRS[name][0]
    if name == "cifar10":
        folder.parent.mkdir(parents=True, exist_ok=True)
        archive = folder.parent / "cifar-10-python.tar.gz"
        _fetch(_URLS[name], archive, min_bytes=150_000_000)
        with tarfile.open(archive) as tar:  # unpacks to cifar-10-batches-py/
            tar.extractall(folder.parent, filter="data")
        archive.unlink()
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for stem in IDX_FILES:
        if not idx_file(folder, stem):
            _fetch(
                _URLS[name] + f"{stem}.gz", folder / f"{stem}.gz", min_bytes=4_000 if "labels" in stem else 1_000_000
            )
    return folder


def find_dataset(name: str, data_dir: str | None) -> Path:
    """The folder holding dataset `name`'s files (downloaded from its canonical source into the cache,
    once, if no folder does);
    DatasetNotFound says where it looked and how to get them. A `data_dir` that is not a folder is
    an error, not a reason to look elsewhere: a mistyped path must not train on another copy."""
    if data_dir and not Path(data_dir).expanduser().is_dir():
        raise DatasetNotFound(f"--data-dir {data_dir}: no such folder")
    searched = _candidates(name, data_dir)
    for folder in searched:
        if _holds(name, folder):
            return folder
    try:
        return _download(name)
    except (OSError, tarfile.TarError) as e:  # URLError, timeouts, short files: OSErrors
        failure = str(e)
    where = "\n".join(f"  {p}" for p in searched)
    if name == "cifar10":
        fetch = f"download {_URLS[name]} and unpack it into DIR (giving DIR/cifar-10-batches-py/)"
    else:
        fetch = f"download {', '.join(s + '.gz' for s in IDX_FILES)} from {_URLS[name]} into DIR"
    how = f"  {fetch},\n  then pass --data-dir DIR (or set DYNABATCH_DATA_DIR=DIR)"
    if name in _DEBIAN_PACKAGES:
        how = (
            f"  apt-get install -y {_DEBIAN_PACKAGES[name]}   (Debian package; installs to "
            f"{SYSTEM_DIR / _SUBDIRS[name][0]}, found there without flags)\nor\n{how}"
        )
    raise DatasetNotFound(
        f"dataset {name!r} is not on this machine, and downloading it from {_URLS[name]} into "
        f"{CACHE_DIR / _SUBDIRS[name][0]} failed: {failure}\nSearched:\n{where}\nTo get it:\n{how}"
    )
