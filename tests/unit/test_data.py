"""Dataset loaders, offline: built-in sets, users' npz/folder data, and torchvision's on-disk formats.

The torchvision tests write tiny files in the real formats (MNIST idx-ubyte, CIFAR pickle
batches) under tmp_path, so the loading code runs exactly as it would on the downloaded files.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torchvision.datasets
from PIL import Image

from rayfed_proto.config import DataConfig
from rayfed_proto.data import DATASETS, ArrayDataset, load_dataset
from rayfed_proto.data.datasets import DatasetNotFoundError, resize_images
from rayfed_proto.registry import UnknownNameError


def test_registry_and_unknown_name():
    assert {"digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "npz", "folder",
            "digits_domains", "multidigits", "office_caltech10", "pacs"} <= set(DATASETS.names())
    assert all(DATASETS.describe(name) for name in DATASETS.names())
    with pytest.raises(UnknownNameError, match="unknown dataset 'imagenet'"):
        load_dataset(DataConfig(name="imagenet"))


# --------------------------------------------------------------------------- ArrayDataset columns


def tiny(n: int = 4, **columns) -> ArrayDataset:
    return ArrayDataset(name="tiny", images=np.zeros((n, 1, 2, 2), dtype=np.uint8), labels=np.arange(n) % 2,
                        num_classes=2, mean=(0.0,), std=(1.0,), **columns)


def test_domains_column_defaults_and_subset():
    ds = tiny(domains=np.array([0, 2, 1, 2], dtype=np.int32))
    assert ds.domains.dtype == np.int64 and ds.domain_names == ["0", "1", "2"] and ds.num_domains == 3
    named = tiny(domains=[1, 0, 1, 1], domain_names=["usps", "mnist"])
    sub = named.subset(np.array([3, 1]))
    assert sub.domains.tolist() == [1, 0] and sub.domain_names == ["usps", "mnist"]
    assert sub.labels.tolist() == [1, 1]
    assert tiny().domains is None and tiny().domain_names == [] and tiny().num_domains == 0
    assert tiny().subset(np.array([0])).domains is None


@pytest.mark.parametrize(("columns", "message"), [
    ({"domains": [0, 1, 0]}, r"column domains has shape \(3,\) for 4 images"),
    ({"domains": [0, -1, 0, 0]}, r"domains must be >= 0"),
    ({"domains": [0.0, 1.0, 0.0, 0.0]}, r"domains must hold integer domain indices"),
    ({"domains": [0, 1, 2, 0], "domain_names": ["a", "b"]}, r"domains goes up to 2 but there are only 2 domain_names"),
    ({"domain_names": ["a", "b"]}, r"domain_names \['a', 'b'\] given without a domains column"),
    ({"domains": [0, 1, 0, 1], "domain_names": ["a", "a"]}, r"domain_names must be distinct"),
])
def test_domains_column_validation(columns, message):
    with pytest.raises(ValueError, match=message):
        tiny(**columns)


# --------------------------------------------------------------------------- built-in


def test_resize_keeps_dtype_rounds_and_antialiases():
    stripes = np.zeros((2, 1, 16, 16), dtype=np.uint8)
    stripes[:, :, ::4] = 255  # one bright row in four
    out = resize_images(stripes, 4)
    assert out.shape == (2, 1, 4, 4) and out.dtype == np.uint8
    # antialiased: the rows average to about 255 / 4; plain bilinear would sample between them (0)
    assert abs(out.astype(float).mean() - 255 / 4) < 10
    checker = (np.indices((16, 16)).sum(axis=0) % 2 * 255).astype(np.uint8)[None, None]
    assert (resize_images(checker, 8)[0, 0, 1:-1, 1:-1] == 128).all()  # 127.5 rounds, not truncates
    floats = np.random.default_rng(0).random((3, 3, 5, 7), dtype=np.float32)
    up = resize_images(floats, 12)
    assert up.shape == (3, 3, 12, 12) and up.dtype == np.float32 and 0 <= up.min() and up.max() <= 1
    assert resize_images(up, 12) is up  # already the right size: no copy



def test_digits_upsampled_to_image_size():
    ds = load_dataset(DataConfig(name="digits", image_size=32))
    assert ds.images.shape == (1797, 1, 32, 32) and ds.images.dtype == np.float32
    assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0 and ds.images.max() > 0.9
    assert set(np.unique(ds.labels)) == set(range(10)) and ds.num_classes == 10


def test_digits_read_from_the_bundled_csv_equal_scikit_learns_loader_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    from rayfed_proto.data.datasets import digits_arrays

    images, labels = digits_arrays()
    bunch = sk_load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    # and the point of reading the file: the driver of a default run does not import SciPy
    code = ("import sys; from rayfed_proto.data.datasets import digits_arrays; digits_arrays(); "
            "print(sorted(m for m in ('scipy', 'sklearn.datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_synthetic_shape_balance_and_determinism():
    cfg = DataConfig(name="synthetic", num_samples=603, num_classes=6, channels=3, image_size=20)
    a, b, c = load_dataset(cfg, seed=5), load_dataset(cfg, seed=5), load_dataset(cfg, seed=6)
    assert a.images.shape == (603, 3, 20, 20) and a.images.dtype == np.float32
    assert 0.0 <= a.images.min() and a.images.max() <= 1.0
    assert a.num_classes == 6 and np.bincount(a.labels).max() - np.bincount(a.labels).min() <= 1
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)


def test_synthetic_classes_are_learnable_but_not_identical():
    ds = load_dataset(DataConfig(name="synthetic", num_samples=2000, num_classes=10, image_size=16), seed=0)
    x, y = ds.images.reshape(len(ds), -1), ds.labels
    train = np.arange(len(y)) < 1000
    means = np.stack([x[train & (y == c)].mean(axis=0) for c in range(10)])
    pred = ((x[~train, None, :] - means[None]) ** 2).sum(axis=-1).argmin(axis=1)
    assert (pred == y[~train]).mean() > 0.8  # nearest class mean separates the classes
    assert x[y == 0].std(axis=0).mean() > 0.1  # samples of a class vary (shift, blend, noise)


# --------------------------------------------------------------------------- npz


def write_npz(path: Path, **arrays) -> DataConfig:
    np.savez(path, **arrays)
    return DataConfig(name="npz", path=str(path), image_size=8)


def test_npz_nhwc_uint8_with_columns(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(12, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(12) % 4
    cfg = write_npz(tmp_path / "mine.npz", images=images, labels=labels, client_ids=np.arange(12) // 6,
                    is_train=np.arange(12) % 2 == 0, class_names=np.array(["a", "b", "c", "d"]))
    ds = load_dataset(cfg)
    assert ds.images.dtype == np.uint8 and np.array_equal(ds.images, images.transpose(0, 3, 1, 2))
    assert np.array_equal(ds.labels, labels) and ds.class_names == ["a", "b", "c", "d"]
    assert np.array_equal(ds.client_ids, np.arange(12) // 6)
    assert ds.is_train.dtype == bool and ds.is_train.sum() == 6
    assert ds.name == "mine"


def test_npz_nchw_floats_in_0_255_are_scaled_and_resized(tmp_path):
    images = np.full((5, 1, 16, 16), 255.0, dtype=np.float64)
    images[:, :, :8] = 51.0
    cfg = write_npz(tmp_path / "d.npz", images=images, labels=np.zeros(5, dtype=np.int64))
    ds = load_dataset(cfg)
    assert ds.images.shape == (5, 1, 8, 8) and ds.images.dtype == np.float32
    assert np.allclose(ds.images[:, :, 0], 0.2) and np.allclose(ds.images[:, :, -1], 1.0)


def test_npz_nhw_unit_floats_and_uint8_resize(tmp_path):
    images = np.random.default_rng(0).random((4, 8, 8)).astype(np.float32)
    ds = load_dataset(write_npz(tmp_path / "a.npz", images=images, labels=[0, 1, 2, 1]))
    assert ds.images.shape == (4, 1, 8, 8) and np.allclose(ds.images[:, 0], images)
    assert ds.num_classes == 3 and ds.client_ids is None and ds.is_train is None
    big = np.full((2, 3, 32, 32), 200, dtype=np.uint8)
    ds = load_dataset(write_npz(tmp_path / "b.npz", images=big, labels=[0, 1]))
    assert ds.images.shape == (2, 3, 8, 8) and ds.images.dtype == np.uint8 and (ds.images == 200).all()


@pytest.mark.parametrize(("arrays", "message"), [
    ({"images": np.zeros((3, 8, 8))}, r"missing key 'labels'"),
    ({"labels": np.zeros(3, dtype=int)}, r"missing key 'images'"),
    ({"images": np.zeros((3, 8, 8)), "labels": np.zeros(4, dtype=int)}, r"'labels' has 4 rows but 'images' has 3"),
    ({"images": np.zeros((3, 8, 8)), "labels": np.zeros(3, dtype=int), "client_ids": np.zeros(2, dtype=int)},
     r"'client_ids' has 2 rows"),
    ({"images": np.zeros((3, 8, 8)), "labels": np.array([0.5, 1, 2])}, r"'labels' must be whole numbers .*found 0\.5 at index 0"),
    ({"images": np.zeros((3, 8, 8)), "labels": np.array([0, -1, 2])}, r"'labels' must be >= 0"),
    ({"images": np.zeros((3, 8, 8, 4)), "labels": np.zeros(3, dtype=int)}, r"channel axis"),
])
def test_npz_errors_name_file_and_key(tmp_path, arrays, message):
    cfg = write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=message) as err:
        load_dataset(cfg)
    assert "bad.npz" in str(err.value)


def test_npz_missing_file(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"nope\.npz.*does not exist"):
        load_dataset(DataConfig(name="npz", path=str(tmp_path / "nope.npz")))


# --------------------------------------------------------------------------- folder


def save_image(path: Path, value: int, mode: str = "L", size: int = 10) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    color = value if mode == "L" else (value, 0, 255 - value)
    Image.new(mode, (size, size), color).save(path)


def test_folder_imagefolder_layout_grayscale(tmp_path):
    for cls, value in (("cat", 10), ("dog", 200)):
        for i in range(3):
            save_image(tmp_path / "imgs" / cls / f"{i}.png", value, size=12)
    ds = load_dataset(DataConfig(name="folder", path=str(tmp_path / "imgs"), image_size=8))
    assert ds.images.shape == (6, 1, 8, 8) and ds.images.dtype == np.uint8
    assert ds.class_names == ["cat", "dog"] and np.array_equal(ds.labels, [0, 0, 0, 1, 1, 1])
    assert (ds.images[ds.labels == 1] == 200).all()
    assert ds.client_ids is None and ds.is_train is None


def test_folder_numeric_class_dirs_are_classes_not_clients(tmp_path):
    for cls in ("0", "1", "2"):
        save_image(tmp_path / cls / "x.png", 50)
    ds = load_dataset(DataConfig(name="folder", path=str(tmp_path), image_size=8))
    assert ds.client_ids is None and np.array_equal(ds.labels, [0, 1, 2])


def test_folder_split_and_client_layout_rgb(tmp_path):
    # <path>/<split>/<client>/<class>/<img>; one RGB image makes the whole set RGB
    layout = {("train", "client_3", "cat"): 3, ("train", "7", "dog"): 2, ("test", "client_3", "cat"): 1,
              ("test", "7", "dog"): 1, ("test", "7", "cat"): 1}
    for (split, client, cls), count in layout.items():
        for i in range(count):
            save_image(tmp_path / split / client / cls / f"{i}.jpg", 100)
    save_image(tmp_path / "train" / "7" / "dog" / "rgb.png", 100, mode="RGB")
    ds = load_dataset(DataConfig(name="folder", path=str(tmp_path), image_size=8))
    assert ds.images.shape == (9, 3, 8, 8)
    assert ds.class_names == ["cat", "dog"]
    assert sorted(zip(ds.client_ids.tolist(), ds.is_train.tolist(), strict=True)).count((3, True)) == 3
    assert sorted(set(ds.client_ids.tolist())) == [3, 7]
    assert ds.is_train.sum() == 6 and (~ds.is_train).sum() == 3
    assert (ds.labels[(ds.client_ids == 3)] == 0).all()


def test_folder_index_csv_replays_a_published_partition(tmp_path):
    for i in range(4):
        save_image(tmp_path / "files" / f"{i}.png", 60 * i)
    (tmp_path / "index.csv").write_text(
        "file,label,client_id,split\n"
        "files/0.png,2,5,train\nfiles/1.png,0,5,test\nfiles/2.png,1,9,train\nfiles/3.png,2,9,TEST\n")
    save_image(tmp_path / "ignored_class" / "x.png", 0)  # the directory layout is not used
    ds = load_dataset(DataConfig(name="folder", path=str(tmp_path), image_size=8))
    assert len(ds) == 4 and ds.num_classes == 3
    assert np.array_equal(ds.labels, [2, 0, 1, 2])
    assert np.array_equal(ds.client_ids, [5, 5, 9, 9])
    assert np.array_equal(ds.is_train, [True, False, True, False])
    assert np.array_equal(ds.images[:, 0, 0, 0], [0, 60, 120, 180])


def test_folder_index_csv_with_class_names_and_bad_rows(tmp_path):
    save_image(tmp_path / "a.png", 1)
    save_image(tmp_path / "b.png", 2)
    (tmp_path / "index.csv").write_text("file,label\na.png,zebra\nb.png,ant\n")
    ds = load_dataset(DataConfig(name="folder", path=str(tmp_path), image_size=8))
    assert ds.class_names == ["ant", "zebra"] and np.array_equal(ds.labels, [1, 0])
    (tmp_path / "index.csv").write_text("file,label\na.png,zebra\nmissing.png,ant\n")
    with pytest.raises(DatasetNotFoundError, match=r"line 3: image .*missing\.png does not exist"):
        load_dataset(DataConfig(name="folder", path=str(tmp_path)))
    (tmp_path / "index.csv").write_text("path,label\na.png,zebra\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) file"):
        load_dataset(DataConfig(name="folder", path=str(tmp_path)))


def test_folder_missing_or_empty_names_path_and_layout(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"nowhere \(data\.path\) does not exist; expected <path>/<class>/<image>") as err:
        load_dataset(DataConfig(name="folder", path=str(tmp_path / "nowhere")))
    assert str(tmp_path / "nowhere") in str(err.value)
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError, match=r"no images found in .*empty"):
        load_dataset(DataConfig(name="folder", path=str(tmp_path / "empty")))


# --------------------------------------------------------------------------- torchvision formats


def write_idx(path: Path, array: np.ndarray) -> None:
    """The MNIST idx-ubyte format: magic (0, 0, 0x08 = uint8, ndim), big-endian dims, data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_idx_files_load_merged(tmp_path, name, folder):
    rng = np.random.default_rng(0)
    train_x, test_x = (rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8) for n in (6, 4))
    train_y, test_y = np.arange(6) % 10, np.array([9, 8, 7, 6])
    raw = tmp_path / folder / "raw"
    for prefix, x, y in (("train", train_x, train_y), ("t10k", test_x, test_y)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", x)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)
    ds = load_dataset(DataConfig(name=name, root=str(tmp_path), image_size=28))
    assert ds.images.shape == (10, 1, 28, 28) and ds.images.dtype == np.uint8
    assert np.array_equal(ds.images[:, 0], np.concatenate([train_x, test_x]))  # train first, then test
    assert np.array_equal(ds.labels, np.concatenate([train_y, test_y])) and ds.num_classes == 10
    resized = load_dataset(DataConfig(name=name, root=str(tmp_path), image_size=32))
    assert resized.images.shape == (10, 1, 32, 32) and resized.images.dtype == np.uint8


def write_cifar(root: Path, monkeypatch, cls, base: str, train: list[str], test: list[str], meta: str,
                meta_key: str, label_key: str, classes: list[str], per_file: int = 3) -> np.ndarray:
    """CIFAR python batches (pickled dicts, rows of 3*32*32 bytes) + meta; returns all images (NHWC).

    torchvision checks each file's md5 against the real release, so the class's md5 lists are
    pointed at these files' md5s: the loading itself is torchvision's.
    """
    folder = root / base
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    images = []

    def md5(name: str) -> str:
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    for i, name in enumerate(train + test):
        rows = rng.integers(0, 256, size=(per_file, 3 * 32 * 32), dtype=np.uint8)
        images.append(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels = [(i + j) % len(classes) for j in range(per_file)]
        (folder / name).write_bytes(pickle.dumps({"data": rows, label_key: labels}))
    (folder / meta).write_bytes(pickle.dumps({meta_key: classes}))
    monkeypatch.setattr(cls, "train_list", [[n, md5(n)] for n in train])
    monkeypatch.setattr(cls, "test_list", [[n, md5(n)] for n in test])
    monkeypatch.setattr(cls, "meta", {"filename": meta, "key": meta_key, "md5": md5(meta)})
    return np.concatenate(images)


def test_cifar10_pickles_load_merged(tmp_path, monkeypatch):
    classes = [f"c{i}" for i in range(10)]
    batches = [f"data_batch_{i}" for i in range(1, 6)]
    expected = write_cifar(tmp_path, monkeypatch, torchvision.datasets.CIFAR10, "cifar-10-batches-py",
                           batches, ["test_batch"], "batches.meta", "label_names", "labels", classes)
    ds = load_dataset(DataConfig(name="cifar10", root=str(tmp_path), image_size=32))
    assert ds.images.shape == (18, 3, 32, 32) and ds.images.dtype == np.uint8
    assert np.array_equal(ds.images, expected.transpose(0, 3, 1, 2))
    assert ds.class_names == classes and ds.num_classes == 10
    assert ds.labels[-3:].tolist() == [5, 6, 7]  # the test batch (file 5) comes last


def test_cifar100_pickles_load_merged_and_downsample(tmp_path, monkeypatch):
    classes = [f"f{i}" for i in range(100)]
    write_cifar(tmp_path, monkeypatch, torchvision.datasets.CIFAR100, "cifar-100-python",
                ["train"], ["test"], "meta", "fine_label_names", "fine_labels", classes, per_file=4)
    ds = load_dataset(DataConfig(name="cifar100", root=str(tmp_path), image_size=16))
    assert ds.images.shape == (8, 3, 16, 16) and ds.images.dtype == np.uint8
    assert ds.num_classes == 100 and ds.labels.tolist() == [0, 1, 2, 3, 1, 2, 3, 4]


@pytest.mark.parametrize(("name", "layout"), [("mnist", "MNIST/raw/"), ("fashion_mnist", "FashionMNIST/raw/"),
                                              ("cifar10", "cifar-10-batches-py/"), ("cifar100", "cifar-100-python/")])
def test_torchvision_sets_offline_error_names_root_and_fix(tmp_path, monkeypatch, name, layout):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(DataConfig(name=name, root="rel_root", download=False))
    msg = str(err.value)
    root = str(tmp_path.resolve() / "rel_root")  # the absolute path, though the config is relative
    assert name in msg and f"under {root}" in msg and f"{root}/{layout}" in msg
    assert "--set data.download=true" in msg
    assert isinstance(err.value, FileNotFoundError)


def test_torchvision_download_failure_is_reported(tmp_path, monkeypatch):
    def no_network(self):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", no_network)
    with pytest.raises(DatasetNotFoundError, match=r"cifar10: download to .* failed \(no network access\?\).*name resolution"):
        load_dataset(DataConfig(name="cifar10", root=str(tmp_path), download=True))
