"""Where a built-in dataset's files are: found on disk, or fetched once into the cache.

Kept free of torch so that `dynabatch run` can check a built-in job's data
before it starts anything, without paying torch's import (2.6 s here) in a
process that never trains.
"""

from __future__ import annotations

import os
import tarfile
import time
import urllib.request
from pathlib import Path

# Module constants rather than literals so that tests (and odd installs) can move them.
SYSTEM_DIR = Path("/usr/share/datasets")
CACHE_DIR = Path.home() / ".cache" / "dynabatch"
DOWNLOAD_TIMEOUT_S = 5.0  # per connect and per read: a dead network fails fast
_DOWNLOAD_DEADLINE_S = 600.0  # whole transfer: a trickling server must not hold us forever

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
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
            _fetch(_URLS[name] + f"{stem}.gz", folder / f"{stem}.gz",
                   min_bytes=4_000 if "labels" in stem else 1_000_000)
    return folder


def find_dataset(name: str, data_dir: str | None) -> Path:
    """The folder holding dataset `name`'s files (downloaded into the cache if no folder does);
    DatasetNotFound says where it looked and how to get them."""
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
        how = (f"  apt-get install -y {_DEBIAN_PACKAGES[name]}   (Debian package; installs to "
               f"{SYSTEM_DIR / _SUBDIRS[name][0]}, found there without flags)\nor\n{how}")
    raise DatasetNotFound(f"dataset {name!r} not found. Searched:\n{where}\n"
                          f"Download from {_URLS[name]} failed: {failure}\nTo get it:\n{how}")
