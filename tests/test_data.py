"""Tests for dynabatch.common.tasks.data: file formats, search and download, batches, sample order."""

from __future__ import annotations

import gc
import gzip
import hashlib
import pickle
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from dynabatch.common.tasks import data, dataset_files
from dynabatch.common.tasks.catalog import DATASETS
from dynabatch.common.tasks.data import Dataset, SampleOrder, load_dataset, make_batch, read_idx
from dynabatch.common.tasks.dataset_files import DatasetNotFound
from tools import need_fashion_mnist


def idx_bytes(arr: np.ndarray) -> bytes:
    """Encode a uint8 array in the idx format: 0, 0, type 0x08, ndim, big-endian dims, data."""
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_idx(path: Path, arr: np.ndarray, compresslevel: int = 9) -> Path:
    raw = idx_bytes(arr)
    if path.suffix == ".gz":
        raw = gzip.compress(raw, compresslevel=compresslevel)
    path.write_bytes(raw)
    return path


def write_fake_mnist(
    folder: Path, n_train: int = 50, n_test: int = 20, gz: bool = True, compresslevel: int = 9, seed: int = 0
) -> dict[str, np.ndarray]:
    """Four idx files of random images and labels, as MNIST-like datasets ship them."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for stem, arr in arrays.items():
        write_idx(folder / (stem + (".gz" if gz else "")), arr, compresslevel)
    return arrays


@pytest.fixture
def no_default_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the system and cache folders at empty temporary ones; returns the cache."""
    monkeypatch.setattr(dataset_files, "SYSTEM_DIR", tmp_path / "system")
    monkeypatch.setattr(dataset_files, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("DYNABATCH_DATA_DIR", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A loopback HTTP server over a temporary folder: (folder, base url)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------- idx files


@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_read_idx_round_trips(tmp_path: Path, name: str) -> None:
    arr = np.random.default_rng(1).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    got = read_idx(write_idx(tmp_path / name, arr))
    assert got.dtype == torch.uint8 and tuple(got.shape) == (7, 5, 3)
    assert np.array_equal(got.numpy(), arr)


@pytest.mark.parametrize("damage", ["truncated", "extra", "magic", "gzip-cut", "header-cut"])
def test_read_idx_rejects_corrupt_file_naming_it(tmp_path: Path, damage: str) -> None:
    raw = idx_bytes(np.arange(60, dtype=np.uint8).reshape(3, 4, 5))
    path = tmp_path / f"broken-{damage}-idx3-ubyte"
    if damage == "truncated":
        path.write_bytes(raw[:-7])
    elif damage == "extra":
        path.write_bytes(raw + b"\1")
    elif damage == "magic":
        path.write_bytes(b"\0\0\x0d" + raw[3:])  # 0x0d: float32, which we do not read
    elif damage == "header-cut":
        path.write_bytes(raw[:9])
    else:
        path = tmp_path / f"broken-{damage}-idx3-ubyte.gz"
        path.write_bytes(gzip.compress(raw)[:-12])
    with pytest.raises(ValueError, match=f"broken-{damage}"):
        read_idx(path)


def test_a_gzipped_idx_file_is_inflated_once_and_then_read_from_the_cache(
    tmp_path: Path, no_default_dirs: Path
) -> None:
    arr = np.random.default_rng(2).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    source = write_idx(tmp_path / "a-idx3-ubyte.gz", arr)
    first = read_idx(source)
    cached = list((no_default_dirs / "inflated").iterdir())
    assert [p.name for p in cached] == [f"a-idx3-ubyte-{zlib.crc32(idx_bytes(arr)):08x}-{len(idx_bytes(arr))}"]
    gz = source.read_bytes()
    source.write_bytes(gz[:10] + gz[-8:])  # its body gone, its trailer kept: only the cache can still give it
    second = read_idx(source)
    del source
    gc.collect()  # the tensor keeps the map it reads alive
    assert np.array_equal(first.numpy(), arr) and np.array_equal(second.numpy(), arr)


@pytest.mark.parametrize("damage", ["flipped", "short", "gone"])
def test_a_damaged_or_missing_cache_entry_is_inflated_again_from_the_source(
    tmp_path: Path, no_default_dirs: Path, damage: str
) -> None:
    arr = np.random.default_rng(3).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    source = write_idx(tmp_path / "b-idx3-ubyte.gz", arr)
    read_idx(source)
    [entry] = (no_default_dirs / "inflated").iterdir()
    raw = bytearray(entry.read_bytes())
    if damage == "flipped":
        raw[100] ^= 1
        entry.write_bytes(raw)
    elif damage == "short":
        entry.write_bytes(raw[:-1])
    else:
        entry.unlink()
    assert np.array_equal(read_idx(source).numpy(), arr)
    assert entry.read_bytes() == idx_bytes(arr), "the damaged entry is replaced"


def test_a_cache_that_cannot_be_written_costs_only_the_inflating(
    tmp_path: Path, no_default_dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arr = np.random.default_rng(4).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    source = write_idx(tmp_path / "c-idx3-ubyte.gz", arr)
    no_default_dirs.mkdir()
    (no_default_dirs / "inflated").write_text("a file where the cache's folder would be")
    assert np.array_equal(read_idx(source).numpy(), arr)
    assert "not caching the inflated c-idx3-ubyte" in capsys.readouterr().err
    assert not list(tmp_path.glob("**/*.tmp"))


# ---------------------------------------------------------------- finding datasets


@pytest.mark.parametrize("sub", ["", "fashion-mnist", "FashionMNIST/raw"])
def test_finds_fashion_mnist_under_data_dir(tmp_path: Path, no_default_dirs: Path, sub: str) -> None:
    arrays = write_fake_mnist(tmp_path / "d" / sub, gz=sub != "")
    ds = load_dataset("fashion-mnist", str(tmp_path / "d"))
    assert ds.train_x.shape == (50, 1, 28, 28) and ds.test_x.shape == (20, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    assert np.array_equal(ds.train_x[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert np.array_equal(ds.test_y.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert (ds.mean, ds.std, ds.num_classes, ds.augment) == ((0.2860,), (0.3530,), 10, False)
    assert ds.input_shape == (1, 28, 28)


def test_finds_mnist_through_env_var(tmp_path: Path, no_default_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fake_mnist(tmp_path / "env" / "MNIST" / "raw")
    monkeypatch.setenv("DYNABATCH_DATA_DIR", str(tmp_path / "env"))
    ds = load_dataset("mnist", None)
    assert ds.name == "mnist" and ds.mean == (0.1307,) and len(ds.train_y) == 50


def test_mismatched_image_and_label_counts_are_an_error(tmp_path: Path, no_default_dirs: Path) -> None:
    write_fake_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(19, dtype=np.uint8))
    with pytest.raises(ValueError, match="t10k"):
        load_dataset("mnist", str(tmp_path))


def test_missing_dataset_says_how_to_get_it_and_fails_fast(
    tmp_path: Path, no_default_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a port nobody listens on: the download is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(dataset_files._URLS, "fashion-mnist", f"http://127.0.0.1:{port}/")
    (tmp_path / "nothing-here").mkdir()  # a --data-dir that is there, without the dataset
    start = time.monotonic()
    with pytest.raises(DatasetNotFound) as info:
        load_dataset("fashion-mnist", str(tmp_path / "nothing-here"))
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert message.startswith(
        f"dataset 'fashion-mnist' is not on this machine, and downloading it from "
        f"http://127.0.0.1:{port}/ into {no_default_dirs / 'fashion-mnist'} failed: "
    )
    assert "apt-get install -y dataset-fashion-mnist" in message
    assert "--data-dir DIR" in message
    for searched in (
        tmp_path / "nothing-here",
        tmp_path / "system" / "fashion-mnist",
        no_default_dirs / "fashion-mnist",
    ):
        assert f"  {searched}\n" in message
    assert isinstance(info.value, FileNotFoundError)
    assert not list(no_default_dirs.rglob("*.gz*")), "a failed download left files behind"


def test_downloads_into_cache_then_loads(
    no_default_dirs: Path, http_dir: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = http_dir
    # Stored (level 0) gzip so the files pass the downloader's minimum-size check.
    arrays = write_fake_mnist(folder, n_train=5000, n_test=5000, compresslevel=0)
    monkeypatch.setitem(dataset_files._URLS, "mnist", url)
    ds = load_dataset("mnist")
    assert sorted(p.name for p in (no_default_dirs / "mnist").iterdir()) == sorted(f"{stem}.gz" for stem in arrays)
    assert np.array_equal(ds.test_x[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])


def test_download_of_a_too_small_file_is_rejected(
    no_default_dirs: Path, http_dir: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = http_dir
    write_fake_mnist(folder)  # a few KB: far below what a real images file weighs
    monkeypatch.setitem(dataset_files._URLS, "mnist", url)
    with pytest.raises(DatasetNotFound, match=r"got \d+ bytes"):
        load_dataset("mnist")
    assert not list(no_default_dirs.rglob("*images*"))


def test_unknown_dataset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="fashion-mnist"):
        load_dataset("imagenet")


def test_every_dataset_a_job_can_name_has_a_spec() -> None:
    """The job schema offers common/tasks/catalog.py's names; each must be one the loader knows."""
    assert set(data.INPUT_SHAPES) == set(DATASETS)


def test_loads_cifar10_python_batches(tmp_path: Path, no_default_dirs: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(2)
    rows = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rows[name] = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, 4).tolist()
        batch = {b"data": rows[name], b"labels": labels, b"batch_label": b"x"}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    ds = load_dataset("cifar10", str(tmp_path))
    assert ds.train_x.shape == (20, 3, 32, 32) and ds.test_x.shape == (4, 3, 32, 32)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    # Rows are 1024 red, then green, then blue values, each plane row-major.
    assert ds.train_x[5, 1, 2, 3] == rows["data_batch_2"][1, 1024 + 2 * 32 + 3]
    assert np.array_equal(ds.test_x.reshape(4, -1).numpy(), rows["test_batch"])
    assert ds.augment and len(ds.mean) == 3 and ds.input_shape == (3, 32, 32)


@pytest.mark.data
def test_real_fashion_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    need_fashion_mnist()
    monkeypatch.delenv("DYNABATCH_DATA_DIR", raising=False)
    ds = load_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10
    assert abs(ds.train_x.float().mean().item() / 255 - ds.mean[0]) < 1e-3


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_with_expected_shapes() -> None:
    a, b = load_dataset("synthetic"), load_dataset("synthetic")
    assert a.train_x.shape == (12000, 1, 28, 28) and a.test_x.shape == (2000, 1, 28, 28)
    assert a.train_x.dtype == torch.uint8 and a.train_y.dtype == torch.int64
    assert a.num_classes == 10 and not a.augment
    assert torch.bincount(a.train_y, minlength=10).min() > 1000
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert a.mean == b.mean and a.std == b.std


def test_synthetic_states_the_mean_and_spread_of_its_training_images() -> None:
    """Stated, as the other datasets' are, rather than computed at every start; this says they are its own."""
    ds = load_dataset("synthetic")
    pixels = ds.train_x.double() / 255
    assert ds.mean[0] == pytest.approx(pixels.mean().item(), abs=5e-5)
    assert ds.std[0] == pytest.approx(pixels.std().item(), abs=5e-5)


SYNTHETIC_DIGEST = """
import hashlib
from dynabatch.common.tasks.data import load_dataset
ds = load_dataset("synthetic")
print(hashlib.sha256(ds.train_x.numpy().tobytes() + ds.test_y.numpy().tobytes()).hexdigest())
"""


def test_synthetic_is_the_same_in_another_process() -> None:
    out = subprocess.run([sys.executable, "-c", SYNTHETIC_DIGEST], capture_output=True, text=True, check=True)
    ds = load_dataset("synthetic")
    here = hashlib.sha256(ds.train_x.numpy().tobytes() + ds.test_y.numpy().tobytes()).hexdigest()
    assert out.stdout.strip() == here


# ---------------------------------------------------------------- batches


def test_make_batch_normalizes_train_and_test() -> None:
    ds = load_dataset("synthetic")
    for train, n in ((True, 12000), (False, 2000)):
        idx = torch.randperm(n)[:2000]
        x, y = make_batch(ds, idx, train)
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape == (2000, 1, 28, 28) and y.shape == (2000,)
        assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05
        assert torch.equal(y, (ds.train_y if train else ds.test_y)[idx])


def _tiny_rgb(augment: bool) -> Dataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8, generator=gen)
    y = torch.arange(16) % 10
    return Dataset("tiny", x, y, x, y, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), 10, augment)


def test_augmentation_is_a_padded_crop_and_flip_of_each_sample() -> None:
    ds = _tiny_rgb(augment=True)
    idx = torch.arange(16)
    x, _ = make_batch(ds, idx, train=True, generator=torch.Generator().manual_seed(0))
    plain, _ = make_batch(ds, idx, train=False)
    again, _ = make_batch(ds, idx, train=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, again) and not torch.equal(x, plain)
    mean, std = torch.tensor(ds.mean).view(3, 1, 1), torch.tensor(ds.std).view(3, 1, 1)
    raw = x * std + mean  # back to [0, 1] pixels, with padding as 0
    padded = torch.nn.functional.pad(ds.train_x.float() / 255, (4, 4, 4, 4))
    flips = 0
    for i in range(16):
        matches = [
            (dy, dx, f)
            for dy in range(9)
            for dx in range(9)
            for f in (False, True)
            if torch.allclose(
                raw[i], (lambda c: c.flip(2) if f else c)(padded[i, :, dy : dy + 8, dx : dx + 8]), atol=1e-5
            )
        ]
        assert matches, f"sample {i} is not a crop of its padded original"
        flips += matches[0][2]
    assert 0 < flips < 16


def test_datasets_without_augmentation_are_not_augmented() -> None:
    ds = _tiny_rgb(augment=False)
    x, _ = make_batch(ds, torch.arange(16), train=True, generator=torch.Generator().manual_seed(0))
    plain, _ = make_batch(ds, torch.arange(16), train=False)
    assert torch.equal(x, plain)


# ---------------------------------------------------------------- sample order


def test_sample_order_covers_every_index_once_per_pass() -> None:
    n, order = 100, SampleOrder(100, seed=5)
    drawn = torch.cat([order.take(7) for _ in range(300 // 7 + 1)])[:300]
    assert drawn.dtype == torch.int64
    passes = drawn.view(3, n)
    for p in passes:
        assert torch.equal(p.sort().values, torch.arange(n))
    assert not torch.equal(passes[0], passes[1]), "each pass should be reshuffled"


def test_sample_order_depends_on_seed_only() -> None:
    assert torch.equal(SampleOrder(1000, 1).take(2500), SampleOrder(1000, 1).take(2500))
    assert not torch.equal(SampleOrder(1000, 1).take(1000), SampleOrder(1000, 2).take(1000))
    order = SampleOrder(10, 0)
    assert order.take(0).shape == (0,) and order.take(25).shape == (25,)
    with pytest.raises(ValueError):
        SampleOrder(0, 0)
