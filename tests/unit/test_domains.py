"""Multi-domain loaders, offline: the embedded digits_domains, and the real sets on tiny files.

MNIST (idx-ubyte), USPS (bz2 libsvm text), SVHN (.mat) and the image folders (PNG) are
written under tmp_path in the formats the real downloads have, so the loading code runs
exactly as it would on the real files.
"""

from __future__ import annotations

import bz2
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torchvision.datasets
from PIL import Image

from rayfed_proto.config import DataConfig
from rayfed_proto.data import DATASETS, DOMAIN_NAMES, load_dataset
from rayfed_proto.data.datasets import DatasetNotFoundError
from rayfed_proto.data.domains import DIGITS_DOMAINS, digits_domain_split

# --------------------------------------------------------------------------- digits_domains


@pytest.fixture(scope="module")
def dd():
    return load_dataset(DataConfig(name="digits_domains", image_size=8))


@pytest.fixture(scope="module")
def plain():
    return load_dataset(DataConfig(name="digits", image_size=8))


def test_registered_with_their_domains():
    assert {"digits_domains", "multidigits", "office_caltech10", "pacs"} <= set(DATASETS.names())
    assert DOMAIN_NAMES == {
        "digits_domains": ["original", "inverted", "rotated", "noisy", "tinted"],
        "multidigits": ["mnist", "usps", "svhn", "synth"],
        "office_caltech10": ["amazon", "caltech", "dslr", "webcam"],
        "pacs": ["art_painting", "cartoon", "photo", "sketch"],
    }


def test_digits_domains_shape_and_columns(dd):
    assert dd.images.shape == (1797, 3, 8, 8) and dd.images.dtype == np.float32
    assert 0.0 <= dd.images.min() and dd.images.max() <= 1.0
    assert dd.domain_names == DIGITS_DOMAINS and dd.domains.dtype == np.int64
    # 1797 = 5 x 359 + 2: domain sizes differ by at most one
    assert sorted(np.bincount(dd.domains).tolist()) == [359, 359, 359, 360, 360]
    assert dd.num_classes == 10 and dd.class_names == [str(d) for d in range(10)]
    # every domain holds every class, evenly (1797 / 10 / 5 is about 36)
    per = np.stack([np.bincount(dd.labels[dd.domains == d], minlength=10) for d in range(5)])
    assert per.min() >= 34 and per.max() <= 37  # class sizes are 174..183


def test_digits_domain_split_is_disjoint_stratified_and_fixed(plain):
    a = digits_domain_split(plain.labels, 5)
    assert np.array_equal(a, digits_domain_split(plain.labels, 5))  # fixed seed
    assert set(np.unique(a)) == set(range(5))  # every image in exactly one domain (a is a function)
    for c in range(10):
        counts = np.bincount(a[plain.labels == c], minlength=5)
        assert counts.max() - counts.min() <= 1


def test_digits_domains_transforms_exact(dd, plain):
    a = digits_domain_split(plain.labels, 5)
    gray = {d: plain.images[a == i] for i, d in enumerate(DIGITS_DOMAINS)}  # (n, 1, 8, 8) in [0, 1]
    got = {d: dd.images[dd.domains == i] for i, d in enumerate(DIGITS_DOMAINS)}
    for i in range(len(DIGITS_DOMAINS)):
        assert np.array_equal(dd.labels[dd.domains == i], plain.labels[a == i])
    rgb = lambda x: np.repeat(x, 3, axis=1)  # noqa: E731
    np.testing.assert_allclose(got["original"], rgb(gray["original"]), atol=1e-6)
    np.testing.assert_allclose(got["inverted"], 1.0 - rgb(gray["inverted"]), atol=1e-6)
    np.testing.assert_allclose(got["rotated"], np.rot90(rgb(gray["rotated"]), 1, axes=(2, 3)), atol=1e-6)
    np.testing.assert_allclose(got["tinted"], rgb(gray["tinted"]) * np.array([1.0, 0.55, 0.1]).reshape(1, 3, 1, 1),
                               atol=1e-6)
    noisy = got["noisy"]
    assert np.array_equal(noisy[:, 0], noisy[:, 1]) and np.array_equal(noisy[:, 0], noisy[:, 2])
    diff = noisy[:, :1] - gray["noisy"]
    assert 0.2 < diff.std() < 0.35  # std 0.3 before clipping


def test_digits_domains_does_not_depend_on_the_run_seed(dd):
    other = load_dataset(DataConfig(name="digits_domains", image_size=8), seed=99)
    assert np.array_equal(other.images, dd.images) and np.array_equal(other.domains, dd.domains)


def test_domain_selection_keeps_the_written_order_and_the_same_images(dd):
    sub = load_dataset(DataConfig(name="digits_domains", image_size=8, domains=["tinted", "original"]))
    assert sub.domain_names == ["tinted", "original"]
    assert np.array_equal(sub.images[sub.domains == 0], dd.images[dd.domains == 4])
    assert np.array_equal(sub.images[sub.domains == 1], dd.images[dd.domains == 0])
    assert len(sub) == (dd.domains == 4).sum() + (dd.domains == 0).sum()


@pytest.mark.parametrize("domains", [["original", "sepia"], [], ["noisy", "noisy"]])
def test_bad_domain_selection_names_key_value_and_allowed(domains):
    with pytest.raises(ValueError, match=r"data\.domains") as err:
        load_dataset(DataConfig(name="digits_domains", domains=domains))
    msg = str(err.value)
    assert str(domains) in msg and "original, inverted, rotated, noisy, tinted" in msg
    if "sepia" in domains:
        assert "'sepia'" in msg


def test_domains_on_a_single_domain_dataset_is_an_error():
    with pytest.raises(ValueError, match=r"data\.domains = \['mnist'\] is set but dataset 'digits' has no domains"):
        load_dataset(DataConfig(name="digits", domains=["mnist"]))


# --------------------------------------------------------------------------- multidigits on real formats


def write_idx(path: Path, array: np.ndarray) -> None:
    """The MNIST idx-ubyte format: magic (0, 0, 0x08 = uint8, ndim), big-endian dims, data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    y = np.array([3, 1, 4, 1, 5])
    for prefix, sl in (("train", slice(0, 3)), ("t10k", slice(3, 5))):
        write_idx(root / "MNIST" / "raw" / f"{prefix}-images-idx3-ubyte", x[sl])
        write_idx(root / "MNIST" / "raw" / f"{prefix}-labels-idx1-ubyte", y[sl])
    return x, y


def write_usps(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """libsvm text, bz2: ``label idx:value ...`` with label in 1..10 and 256 values in [-1, 1]."""
    rng = np.random.default_rng(1)
    values = rng.integers(-4, 5, size=(4, 256)) / 4.0  # exact in binary
    labels = np.array([1, 10, 5, 2])  # torchvision subtracts 1
    (root / "USPS").mkdir(parents=True)
    for name, rows in (("usps.bz2", [0, 1, 2]), ("usps.t.bz2", [3])):
        lines = [f"{labels[r]} " + " ".join(f"{i + 1}:{v:g}" for i, v in enumerate(values[r])) for r in rows]
        (root / "USPS" / name).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    pixels = ((values + 1) / 2 * 255).astype(np.uint8).reshape(4, 16, 16)
    return pixels, labels - 1


def write_svhn(root: Path, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """.mat files with X (32, 32, 3, N) uint8 and y (N, 1), 10 standing for digit 0.

    torchvision checks each file's md5 against the real release, so split_list is pointed at
    these files' md5s: the loading itself is torchvision's.
    """
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, size=(32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    (root / "SVHN").mkdir(parents=True)
    for split, cols in (("train", [0, 1, 2]), ("test", [3, 4])):
        path = root / "SVHN" / f"{split}_32x32.mat"
        scipy.io.savemat(path, {"X": x[..., cols], "y": y[cols]})
        url, name, _ = torchvision.datasets.SVHN.split_list[split]
        monkeypatch.setitem(torchvision.datasets.SVHN.split_list, split,
                            [url, name, hashlib.md5(path.read_bytes()).hexdigest()])
    return x.transpose(3, 2, 0, 1), np.array([0, 1, 2, 0, 9])


def save_png(path: Path, color, size: int = 10, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (size, size), color).save(path)


def write_synth(root: Path) -> None:
    save_png(root / "SynthDigits" / "train" / "7" / "a.png", (200, 10, 10))
    save_png(root / "SynthDigits" / "train" / "2" / "b.png", (10, 200, 10))
    save_png(root / "SynthDigits" / "test" / "7" / "c.png", (10, 10, 200))


def test_mnist_domain_from_idx_files(tmp_path):
    x, y = write_mnist(tmp_path)
    ds = load_dataset(DataConfig(name="multidigits", root=str(tmp_path), image_size=28, domains=["mnist"]))
    assert ds.images.shape == (5, 3, 28, 28) and ds.images.dtype == np.uint8
    assert all(np.array_equal(ds.images[:, c], x) for c in range(3))  # gray replicated
    assert np.array_equal(ds.labels, y) and ds.domain_names == ["mnist"] and (ds.domains == 0).all()


def test_usps_domain_from_bz2_libsvm(tmp_path):
    pixels, labels = write_usps(tmp_path)
    ds = load_dataset(DataConfig(name="multidigits", root=str(tmp_path), image_size=16, domains=["usps"]))
    assert ds.images.shape == (4, 3, 16, 16)
    assert np.array_equal(ds.images[:, 1], pixels) and np.array_equal(ds.labels, labels)  # train, then test


def test_svhn_domain_from_mat_files(tmp_path, monkeypatch):
    images, labels = write_svhn(tmp_path, monkeypatch)
    ds = load_dataset(DataConfig(name="multidigits", root=str(tmp_path), image_size=32, domains=["svhn"]))
    assert ds.images.shape == (5, 3, 32, 32) and np.array_equal(ds.images, images)
    assert np.array_equal(ds.labels, labels)  # label 10 means digit 0


def test_synth_domain_from_png_folder(tmp_path):
    write_synth(tmp_path)
    ds = load_dataset(DataConfig(name="multidigits", root=str(tmp_path), image_size=8, domains=["synth"]))
    assert ds.images.shape == (3, 3, 8, 8)
    assert ds.labels.tolist() == [2, 7, 7]  # train/ (classes sorted) then test/
    assert ds.images[0, :, 0, 0].tolist() == [10, 200, 10]


def test_all_four_digit_domains_together(tmp_path, monkeypatch):
    write_mnist(tmp_path)
    write_usps(tmp_path)
    write_svhn(tmp_path, monkeypatch)
    write_synth(tmp_path)
    ds = load_dataset(DataConfig(name="multidigits", root=str(tmp_path), image_size=12))
    assert ds.images.shape == (5 + 4 + 5 + 3, 3, 12, 12) and ds.images.dtype == np.uint8
    assert ds.domain_names == ["mnist", "usps", "svhn", "synth"]
    assert np.bincount(ds.domains).tolist() == [5, 4, 5, 3]
    assert ds.class_names == [str(d) for d in range(10)]


@pytest.mark.parametrize(("domain", "layout"), [
    ("mnist", "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    ("usps", "USPS/{usps.bz2,usps.t.bz2}"),
    ("svhn", "SVHN/{train_32x32.mat,test_32x32.mat}"),
    ("synth", "SynthDigits/{train,test}/<0..9>/<image>"),
])
def test_missing_digit_domain_names_the_layout(tmp_path, domain, layout):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(DataConfig(name="multidigits", root=str(tmp_path), domains=[domain]))
    msg = str(err.value)
    assert f"multidigits domain '{domain}'" in msg and f"{tmp_path}/{layout}" in msg
    if domain != "synth":
        assert "--set data.download=true" in msg


# --------------------------------------------------------------------------- image-folder sets


def test_office_caltech10_folders(tmp_path):
    base = tmp_path / "office_caltech_10"
    for domain, color in (("amazon", (255, 0, 0)), ("caltech", (0, 255, 0)), ("dslr", (0, 0, 255)),
                          ("webcam", (9, 9, 9))):
        save_png(base / domain / "mug" / "1.png", color, size=20)
        save_png(base / domain / "bike" / "1.bmp", color, size=14)
    save_png(base / "dslr" / "bike" / "gray.png", 77, mode="L")  # a gray image is replicated to RGB
    ds = load_dataset(DataConfig(name="office_caltech10", root=str(tmp_path), image_size=8))
    assert ds.images.shape == (9, 3, 8, 8) and ds.images.dtype == np.uint8
    assert ds.domain_names == ["amazon", "caltech", "dslr", "webcam"] and ds.class_names == ["bike", "mug"]
    assert np.bincount(ds.domains).tolist() == [2, 2, 3, 2]
    assert ds.labels[ds.domains == 0].tolist() == [0, 1]
    assert ds.images[ds.domains == 1][:, :, 4, 4].tolist() == [[0, 255, 0], [0, 255, 0]]
    gray = ds.images[(ds.domains == 2)][1]
    assert (gray == 77).all()


@pytest.mark.parametrize("subdir", ["PACS", "PACS/kfold"])
def test_pacs_folders_plain_or_official_kfold(tmp_path, subdir):
    for domain in ("sketch", "photo"):
        for cls in ("dog", "house"):
            save_png(tmp_path / subdir / domain / cls / "0.png", (50, 60, 70), size=9)
    ds = load_dataset(DataConfig(name="pacs", root=str(tmp_path), image_size=8, domains=["sketch", "photo"]))
    assert ds.domain_names == ["sketch", "photo"] and ds.class_names == ["dog", "house"]
    assert len(ds) == 4 and ds.domains.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize(("name", "expected"), [
    ("office_caltech10", "office_caltech_10/<domain>/<class>/<image> with domain directories amazon, caltech, dslr, webcam"),
    ("pacs", "PACS/<domain>/<class>/<image> with domain directories art_painting, cartoon, photo, sketch"),
])
def test_missing_folder_set_names_the_layout(tmp_path, name, expected):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(DataConfig(name=name, root=str(tmp_path)))
    assert f"{tmp_path}/{expected}" in str(err.value)


def test_missing_domain_directory_is_named(tmp_path):
    save_png(tmp_path / "office_caltech_10" / "amazon" / "mug" / "0.png", (1, 2, 3))
    with pytest.raises(DatasetNotFoundError, match=r"domain directory .*office_caltech_10/caltech does not exist"):
        load_dataset(DataConfig(name="office_caltech10", root=str(tmp_path)))
    ds = load_dataset(DataConfig(name="office_caltech10", root=str(tmp_path), domains=["amazon"], image_size=4))
    assert len(ds) == 1 and ds.domain_names == ["amazon"]
