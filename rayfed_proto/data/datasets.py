"""Dataset loaders: every source becomes one in-memory :class:`ArrayDataset`.

Each loader is registered in ``DATASETS`` under the name used by ``data.name`` and has the
signature ``(cfg: DataConfig, seed: int) -> ArrayDataset``. All of them return square images
of side ``cfg.image_size`` so that every client model sees one input shape, whatever the source.

* ``digits``: scikit-learn's bundled 8x8 digits, the offline default.
* ``synthetic``: class-conditional smooth patterns of any size and count, for scaling tests.
* ``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: torchvision's files. The official
  train and test splits are merged because, as in HtFLlib/FedSA, the whole set is partitioned
  over clients and each client's share is then split 75/25 (``nway_kshot``: the k shots all
  train and the test sets are drawn apart; see ``partition.make_partition``).
* ``npz`` and ``folder``: users' own data, optionally carrying a natural client partition
  (``client_ids``) and a fixed train/test split (``is_train``).
* ``hf``: a Hugging Face ``datasets`` dataset (a ``save_to_disk`` folder or a Hub name), with
  configurable image, label and client columns and splits; needs the optional ``datasets``
  package (``pip install 'rayfed_proto[hf]'``).
* multi-domain sets (``digits_domains``, ``multidigits``, ``office_caltech10``, ``pacs``) are
  in ``domains.py``; they fill ``ArrayDataset.domains``.

torch, torchvision, PIL, scikit-learn and ``datasets`` are imported inside the functions that use them:
``rayfed_proto.data`` is imported with the package (it registers the config check of
``data.name``), by config validation and the CLI, which must stay quick.
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from rayfed_proto.config import (
    ConfigIssue,
    DataConfig,
    ExperimentConfig,
    InputError,
    register_check,
    unknown_name_issues,
)
from rayfed_proto.data import DATASETS
from rayfed_proto.data.base import ArrayDataset


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not where the config says; the message says how to fix it."""


def load_dataset(cfg: DataConfig, seed: int = 0) -> ArrayDataset:
    """Load ``cfg.name`` through the registry (an unknown name raises ``UnknownNameError``)."""
    loader: Callable[[DataConfig, int], ArrayDataset] = DATASETS.get(cfg.name)
    dataset = loader(cfg, seed)
    if cfg.domains is not None and dataset.domains is None:
        raise ValueError(f"data.domains = {cfg.domains} is set but dataset {cfg.name!r} has no domains; it applies to "
                         f"the multi-domain sets (digits_domains, multidigits, office_caltech10, pacs)")
    return dataset


@register_check("data")
def dataset_name_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``data.name`` is a registered dataset (checked when the config is validated, before Ray starts)."""
    return unknown_name_issues("data.name", cfg.data.name, DATASETS)


# --------------------------------------------------------------------------- resizing

# Bound on the float32 elements converted at once while resizing (64 MiB), so resizing
# 70k MNIST images never holds a float copy of the whole set.
_RESIZE_CHUNK_ELEMS = 1 << 24


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Resize (N, C, H, W) images to (N, C, size, size), keeping the dtype.

    Bilinear, antialiased when shrinking. uint8 input stays uint8 (rounded), float input is
    clipped to [0, 1]; the work is done in chunks to bound memory.
    """
    n, c, h, w = images.shape
    if (h, w) == (size, size):
        return images
    import torch
    import torch.nn.functional as F

    out = np.empty((n, c, size, size), dtype=images.dtype)
    antialias = size < h or size < w
    chunk = max(1, _RESIZE_CHUNK_ELEMS // (c * max(h * w, size * size)))
    for start in range(0, n, chunk):
        x = torch.from_numpy(np.ascontiguousarray(images[start : start + chunk])).float()
        y = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=antialias)
        if images.dtype == np.uint8:
            y = y.round_().clamp_(0, 255).to(torch.uint8)
        else:
            y = y.clamp_(0.0, 1.0)
        out[start : start + chunk] = y.numpy()
    return out


# --------------------------------------------------------------------------- built-in sets


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: (images 1797 x 8 x 8 with values 0..16, integer labels).

    Read from the ``digits.csv.gz`` scikit-learn ships, as its ``load_digits`` does, but without
    importing ``sklearn.datasets`` (which pulls in SciPy: about 70 MiB in the driver of every
    run on the default dataset). Falls back to ``load_digits`` where the file is not found."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sk_load_digits

        bunch = sk_load_digits()
        return bunch.images, bunch.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


@DATASETS.register("digits", help="scikit-learn's 1797 8x8 handwritten digits (offline, 10 classes)")
def load_digits(cfg: DataConfig, seed: int) -> ArrayDataset:
    digits, target = digits_arrays()
    # pixel values are 0..16
    images = (digits.astype(np.float32) / 16.0)[:, None]
    return ArrayDataset(
        name="digits", images=resize_images(images, cfg.image_size), labels=target,
        num_classes=10, class_names=[str(d) for d in range(10)],
    )


# Per-class templates are drawn at this resolution and upsampled, so they are smooth blobs.
# Each sample is its class template at a random shift (up to image_size / 8), blended with
# a random other class's template (weight up to 0.4) and with pixel noise. The classes are
# learnable (nearest class mean scores about 0.95 on 10k 1-channel 32x32 images) but overlap.
_SYNTH_TEMPLATE_RES = 4
_SYNTH_MAX_BLEND = 0.4
_SYNTH_NOISE_STD = 0.25


@DATASETS.register("synthetic", help="seeded class-conditional smooth patterns of any size and count")
def load_synthetic(cfg: DataConfig, seed: int) -> ArrayDataset:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    n, k, c, size = cfg.num_samples, cfg.num_classes, cfg.channels, cfg.image_size
    shift = max(1, size // 8)
    span = 2 * shift + 1  # offsets 0..2*shift in each direction
    low = rng.random((k, c, _SYNTH_TEMPLATE_RES, _SYNTH_TEMPLATE_RES), dtype=np.float32)
    templates = F.interpolate(torch.from_numpy(low), size=(size + 2 * shift,) * 2, mode="bilinear",
                              align_corners=False).numpy()
    labels = rng.permutation(np.arange(n) % k)  # balanced: class counts differ by at most one
    offsets = rng.integers(0, span * span, size=n)
    other = (labels + rng.integers(1, k, size=n)) % k  # a class other than the sample's own
    blend = rng.uniform(0, _SYNTH_MAX_BLEND, size=n).astype(np.float32)[:, None, None, None]
    centred = templates[:, :, shift : shift + size, shift : shift + size]
    images = np.empty((n, c, size, size), dtype=np.float32)
    # built per distinct offset (at most span^2 groups): slices instead of a per-sample gather,
    # and temporaries of one group's size rather than the whole set's
    for off in np.unique(offsets):
        dy, dx = divmod(int(off), span)
        mask = offsets == off
        group = templates[labels[mask], :, dy : dy + size, dx : dx + size]
        group *= 1 - blend[mask]
        group += blend[mask] * centred[other[mask]]
        group += rng.standard_normal(group.shape, dtype=np.float32) * _SYNTH_NOISE_STD
        images[mask] = np.clip(group, 0.0, 1.0, out=group)
    return ArrayDataset(name="synthetic", images=images, labels=labels, num_classes=k)


# --------------------------------------------------------------------------- torchvision sets


@dataclass(frozen=True)
class _TorchvisionSpec:
    class_name: str  # attribute of torchvision.datasets
    layout: str  # what a complete offline copy looks like under root, for error messages


_TORCHVISION_SETS = {
    "mnist": _TorchvisionSpec("MNIST", "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "fashion_mnist": _TorchvisionSpec("FashionMNIST", "FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "cifar10": _TorchvisionSpec("CIFAR10", "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)"),
    "cifar100": _TorchvisionSpec("CIFAR100", "cifar-100-python/ (train, test, meta)"),
}


def open_torchvision(name: str, class_name: str, root: Path, layout: str, download: bool,
                     split_kwargs: list[dict]) -> list:
    """Instantiate ``torchvision.datasets.<class_name>(root, **kw, download)`` for each split.

    Missing or corrupt files, and failed downloads, become a :class:`DatasetNotFoundError`
    whose message names ``root`` and the expected ``layout`` (relative to ``root``).
    """
    import torchvision.datasets

    cls = getattr(torchvision.datasets, class_name)
    fix = (f"run with --set data.download=true on a machine with network access, or place the files "
           f"under {root} in torchvision's layout: {root}/{layout}")
    splits = []
    lock = contextlib.nullcontext()
    if download:  # one download at a time per dataset and folder (concurrent runs, sweep trials)
        from filelock import FileLock

        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f".{class_name}.download.lock"))
    for kwargs in split_kwargs:
        try:
            with lock:
                splits.append(cls(root=str(root), download=download, **kwargs))
        # torchvision reports missing or corrupt files as RuntimeError; a failed download as
        # URLError/socket errors (OSError) or RuntimeError
        except (RuntimeError, OSError) as err:
            if download:
                raise DatasetNotFoundError(
                    f"{name}: download to {root} failed (no network access?): {err}. Fix: {fix}") from err
            raise DatasetNotFoundError(
                f"{name}: dataset files not found (or incomplete) under {root} and data.download is false. "
                f"Fix: {fix}") from err
    return splits


def _load_torchvision(name: str, cfg: DataConfig) -> ArrayDataset:
    spec = _TORCHVISION_SETS[name]
    root = Path(cfg.root).expanduser().resolve()
    splits = open_torchvision(name, spec.class_name, root, spec.layout, cfg.download, [{"train": True}, {"train": False}])
    images, labels = [], []
    for ds in splits:
        data = np.asarray(ds.data)  # MNIST: torch uint8 (N, H, W); CIFAR: numpy uint8 (N, H, W, C)
        images.append(data[:, None] if data.ndim == 3 else data.transpose(0, 3, 1, 2))
        labels.append(np.asarray(ds.targets, dtype=np.int64))
    classes = [str(x) for x in splits[0].classes]
    return ArrayDataset(
        name=name, images=resize_images(np.concatenate(images), cfg.image_size),
        labels=np.concatenate(labels), num_classes=len(classes), class_names=classes,
    )


def _register_torchvision(name: str, help: str) -> None:
    def loader(cfg: DataConfig, seed: int) -> ArrayDataset:
        return _load_torchvision(name, cfg)

    loader.__name__ = f"load_{name}"
    DATASETS.add(name, loader, help)


_register_torchvision("mnist", "torchvision MNIST, train+test merged (70k 28x28 gray, 10 classes)")
_register_torchvision("fashion_mnist", "torchvision FashionMNIST, train+test merged (70k 28x28 gray, 10 classes)")
_register_torchvision("cifar10", "torchvision CIFAR-10, train+test merged (60k 32x32 RGB, 10 classes)")
_register_torchvision("cifar100", "torchvision CIFAR-100, train+test merged (60k 32x32 RGB, 100 classes)")


# --------------------------------------------------------------------------- user data: npz


def _require_path(cfg: DataConfig) -> Path:
    if not cfg.path:
        raise ValueError(f"data.path is required when data.name is {cfg.name!r}")
    return Path(cfg.path).expanduser().resolve()


def _to_nchw(images: np.ndarray, where: str, key: str = "'images'") -> np.ndarray:
    """Bring (N, H, W), (N, H, W, C) or (N, C, H, W) to (N, C, H, W), C in {1, 3}."""
    if images.ndim == 3:
        return images[:, None]
    if images.ndim != 4:
        raise ValueError(f"{where}: {key} must be (N, H, W), (N, H, W, C) or (N, C, H, W); got shape {images.shape}")
    _, d1, d2, d3 = images.shape
    # a trailing 1/3 is the channel axis unless dims 1, 2 cannot be H, W and dim 1 can be C
    if d3 in (1, 3) and (d1 == d2 or d1 not in (1, 3)):
        return images.transpose(0, 3, 1, 2)
    if d1 in (1, 3):
        return images
    raise ValueError(f"{where}: cannot find a channel axis of size 1 or 3 in {key} of shape {images.shape}")


def _to_unit_range(images: np.ndarray, where: str, key: str = "'images'") -> np.ndarray:
    """uint8 stays uint8; other integers must be 0..255; floats above 1 are taken as 0..255."""
    if images.dtype == np.uint8:
        return images
    if np.issubdtype(images.dtype, np.floating) or np.issubdtype(images.dtype, np.complexfloating):
        bad = ~np.isfinite(images)
        if bad.any():  # NaN compares False both ways: the range checks below would let it through
            first = int(np.argmax(bad.reshape(len(images), -1).any(axis=1)))
            raise ValueError(f"{where}: {key} contain NaN/inf: {int(bad.sum())} values in "
                             f"{int(bad.reshape(len(images), -1).any(axis=1).sum())} images, the first at index {first}; "
                             "every pixel must be a finite number (uint8 0..255, or floats in [0, 1] or [0, 255])")
    lo, hi = float(images.min()), float(images.max())
    if np.issubdtype(images.dtype, np.integer):
        if lo < 0 or hi > 255:
            raise ValueError(f"{where}: integer {key} must be in 0..255, found {lo:g}..{hi:g}")
        return images.astype(np.uint8)
    if not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f"{where}: {key} must be numeric, got dtype {images.dtype}")
    if lo < 0 or hi > 255:
        raise ValueError(f"{where}: float {key} must be in [0, 1] or [0, 255], found {lo:g}..{hi:g}")
    x = images.astype(np.float32)
    return x / 255.0 if hi > 1.0 else x


def zlib_error() -> type:
    import zlib

    return zlib.error


def dataset_warnings(dataset: ArrayDataset) -> list[str]:
    """Things that make a run pointless although nothing is invalid (printed before training)."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        return []
    present = np.unique(np.asarray(labels))
    if len(present) < 2:
        return [f"dataset {dataset.name!r} has a single class ({present.tolist()}): every prediction is trivially right "
                "and prototypes cannot separate anything; check data.path / the labels"]
    return []


def _int_column(values: np.ndarray, key: str, where: str) -> np.ndarray:
    """An integer (N,) column; floats are accepted only when every value is whole."""
    if values.ndim != 1:
        raise ValueError(f"{where}: {key!r} must be one-dimensional, got shape {values.shape}")
    integral = np.issubdtype(values.dtype, np.integer) or (
        np.issubdtype(values.dtype, np.floating) and bool(np.all(np.isfinite(values)))
        and bool(np.all(values == np.round(values))))
    if not integral:
        if np.issubdtype(values.dtype, np.floating):
            odd = ~np.isfinite(values) | (values != np.round(np.nan_to_num(values)))
            first = int(np.argmax(odd))
            raise ValueError(f"{where}: {key!r} must be whole numbers (class indices 0, 1, 2, ...), found "
                             f"{values[first].item()!r} at index {first} ({int(odd.sum())} such values)")
        raise ValueError(f"{where}: {key!r} must hold integers, got dtype {values.dtype}")
    return values.astype(np.int64)


@DATASETS.register("npz", help="a .npz file at data.path: images, labels [, client_ids, is_train, class_names]")
def load_npz(cfg: DataConfig, seed: int) -> ArrayDataset:
    """Load ``images`` and ``labels`` (plus the optional columns) from ``cfg.path``.

    ``images``: (N, H, W), (N, H, W, C) or (N, C, H, W) with C in {1, 3}; uint8, or floats in
    [0, 1] or [0, 255]. ``labels``: (N,) integers >= 0. Optional: ``client_ids`` (N,) integers
    (used by the ``natural`` partitioner), ``is_train`` (N,) bool (replaces the per-client
    split), ``class_names`` (num_classes,) strings.
    """
    path = _require_path(cfg)
    if not path.is_file():
        raise DatasetNotFoundError(f"npz dataset: file {path} (data.path) does not exist")
    where = str(path)
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as f:
            if not hasattr(f, "files"):  # a bare .npy saved under a .npz name
                raise ValueError("it holds a single array, not named arrays")
            arrays = {key: f[key] for key in f.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib_error()) as e:
        raise ValueError(f"{where}: not a readable .npz archive ({type(e).__name__}: {e}); expected a file written by "
                         "numpy.savez / savez_compressed with at least 'images' and 'labels' (data.path)") from None
    for key in ("images", "labels"):
        if key not in arrays:
            raise ValueError(f"{where}: missing key {key!r} (keys present: {', '.join(sorted(arrays)) or 'none'})")
    if len(arrays["images"]) == 0:
        raise ValueError(f"{where}: 'images' is empty")
    images = _to_unit_range(_to_nchw(arrays["images"], where), where)
    n = len(images)
    for key in ("labels", "client_ids", "is_train"):
        if key in arrays and len(arrays[key]) != n:
            raise ValueError(f"{where}: {key!r} has {len(arrays[key])} rows but 'images' has {n}")
    labels = _int_column(arrays["labels"], "labels", where)
    if labels.min() < 0:
        raise ValueError(f"{where}: 'labels' must be >= 0, found {labels.min()}")
    num_classes = int(labels.max()) + 1
    class_names: list[str] = []
    if "class_names" in arrays:
        class_names = [str(x) for x in arrays["class_names"].reshape(-1)]
        if len(class_names) < num_classes:
            raise ValueError(f"{where}: 'class_names' has {len(class_names)} entries but labels go up to {num_classes - 1}")
        num_classes = len(class_names)
    client_ids = _int_column(arrays["client_ids"], "client_ids", where) if "client_ids" in arrays else None
    is_train = None
    if "is_train" in arrays:
        raw = arrays["is_train"]
        if raw.dtype != np.bool_ and not np.isin(raw, (0, 1)).all():
            raise ValueError(f"{where}: 'is_train' must be bool (or 0/1), got dtype {raw.dtype}")
        is_train = raw.astype(bool)
    return ArrayDataset(
        name=path.stem, images=resize_images(images, cfg.image_size), labels=labels,
        num_classes=num_classes, class_names=class_names, client_ids=client_ids, is_train=is_train,
    )


# --------------------------------------------------------------------------- user data: folder

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
_GRAY_MODES = {"1", "L", "LA"}
_CLIENT_DIR = re.compile(r"^(?:client_)?(\d+)$")
_FOLDER_LAYOUT = (
    "<path>/<class>/<image> (ImageFolder), optionally under <path>/train/ and <path>/test/ and/or "
    "per-client <client_N or N>/ directories (<path>/[<train|test>/][<client_N>/]<class>/<image>), "
    "or an index file <path>/index.csv with columns file,label[,client_id][,split]"
)


@dataclass
class _Record:
    file: Path
    label: str  # class name, or an integer label as text (index.csv)
    client_id: Optional[int]
    is_train: Optional[bool]


def _subdirs(p: Path) -> list[Path]:
    return sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))


def _is_image(p: Path) -> bool:
    return p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file()


def _client_dirs(base: Path) -> list[tuple[Optional[int], Path]]:
    """``[(client_id, dir_with_class_dirs)]``; ``[(None, base)]`` when there is no client level.

    A level is per-client when every directory in it is named ``client_N`` or ``N`` and holds
    class directories rather than images (so numeric class names such as ``0``..``9`` are
    still read as classes).
    """
    dirs = _subdirs(base)
    is_client_level = bool(dirs) and all(
        _CLIENT_DIR.match(d.name) and _subdirs(d) and not any(_is_image(f) for f in d.iterdir()) for d in dirs
    )
    if not is_client_level:
        return [(None, base)]
    return [(int(_CLIENT_DIR.match(d.name).group(1)), d) for d in dirs]


def _scan_directories(root: Path) -> list[_Record]:
    top = {d.name: d for d in _subdirs(root)}
    if top and set(top) <= {"train", "test"}:
        if set(top) != {"train", "test"}:
            raise ValueError(f"{root}: found only {next(iter(top))}/; a split layout needs both train/ and test/ "
                             f"(expected {_FOLDER_LAYOUT})")
        groups: list[tuple[Path, Optional[bool]]] = [(top["train"], True), (top["test"], False)]
    else:
        groups = [(root, None)]
    records = []
    for base, is_train in groups:
        for client_id, class_root in _client_dirs(base):
            for class_dir in _subdirs(class_root):
                records.extend(_Record(f, class_dir.name, client_id, is_train)
                               for f in sorted(class_dir.rglob("*")) if _is_image(f))
    if records and len({r.client_id is None for r in records}) > 1:
        raise ValueError(f"{root}: train/ and test/ must both use per-client directories or neither")
    return records


def _read_index(root: Path, index: Path) -> list[_Record]:
    with open(index, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        missing = {"file", "label"} - set(columns)
        if missing:
            raise ValueError(f"{index}: missing column(s) {', '.join(sorted(missing))}; "
                             f"expected file,label[,client_id][,split], found {','.join(columns)}")
        records = []
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            file = root / row["file"]
            if not file.is_file():
                raise DatasetNotFoundError(f"{index} line {line}: image {file} does not exist")
            client_id = None
            if row.get("client_id"):
                try:
                    client_id = int(row["client_id"])
                except ValueError:
                    raise ValueError(f"{index} line {line}: client_id {row['client_id']!r} is not an integer") from None
            is_train = None
            if row.get("split"):
                split = row["split"].lower()
                if split not in ("train", "test"):
                    raise ValueError(f"{index} line {line}: split must be 'train' or 'test', got {row['split']!r}")
                is_train = split == "train"
            records.append(_Record(file, row["label"], client_id, is_train))
    for col, values in (("client_id", [r.client_id for r in records]), ("split", [r.is_train for r in records])):
        if len({v is None for v in values}) > 1:
            raise ValueError(f"{index}: column {col} must be filled on every row or on none")
    return records


def _decode_images(sources: Sequence[Path | bytes], size: int,
                   describe: Optional[Callable[[int], str]] = None) -> np.ndarray:
    """(N, C, size, size) uint8 from image files or encoded images (bytes); C = 1 when every
    image is grayscale, else RGB. ``describe(i)`` names image i in errors (default: its path)."""
    from PIL import Image

    def open_image(src: Path | bytes):
        return Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src)

    modes = []
    for i, src in enumerate(sources):
        try:
            with open_image(src) as im:  # reads the header only
                modes.append(im.mode)
        except OSError as err:
            raise ValueError(f"cannot read image {describe(i) if describe else src}: {err}") from None
    mode = "L" if all(m in _GRAY_MODES for m in modes) else "RGB"
    out = np.empty((len(sources), 1 if mode == "L" else 3, size, size), dtype=np.uint8)
    for i, src in enumerate(sources):
        with open_image(src) as im:
            # images can differ in size, so each is resized on its own; PIL's bilinear filter
            # widens its support when shrinking, i.e. it antialiases like the torch path
            arr = np.asarray(im.convert(mode).resize((size, size), Image.Resampling.BILINEAR))
        out[i] = arr[None] if mode == "L" else arr.transpose(2, 0, 1)
    return out


def _labels_from_names(values: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Class ids and class names for labels given as text: when every name is an integer it
    keeps its value (class names ``"0"`` .. max); otherwise the names are sorted and numbered."""
    names = sorted(set(values))
    if all(re.fullmatch(r"\d+", name) for name in names):
        labels = np.array([int(v) for v in values], dtype=np.int64)
        return labels, [str(c) for c in range(int(labels.max()) + 1)]
    lookup = {name: i for i, name in enumerate(names)}
    return np.array([lookup[v] for v in values], dtype=np.int64), names


@DATASETS.register("folder", help="an image folder at data.path (<class>/<image>, optional train|test and client_N levels, or index.csv)")
def load_folder(cfg: DataConfig, seed: int) -> ArrayDataset:
    """Load images from ``cfg.path``; see ``_FOLDER_LAYOUT`` for the accepted layouts.

    With ``index.csv`` present the directory layout is ignored: each row names an image
    (relative to ``cfg.path``), its label (a class name, or an integer class index), and
    optionally its client and split, so a partition published by another library is
    replayed exactly. Client directories/ids become ``client_ids`` (for the ``natural``
    partitioner) and train/test become ``is_train``.
    """
    root = _require_path(cfg)
    if not root.is_dir():
        raise DatasetNotFoundError(f"folder dataset: directory {root} (data.path) does not exist; expected {_FOLDER_LAYOUT}")
    index = root / "index.csv"
    records = _read_index(root, index) if index.is_file() else _scan_directories(root)
    if not records:
        raise DatasetNotFoundError(f"folder dataset: no images found in {root}; expected {_FOLDER_LAYOUT}")
    # integer labels (index.csv, or numeric class directories) keep their value
    labels, class_names = _labels_from_names([r.label for r in records])
    has_clients = records[0].client_id is not None
    has_split = records[0].is_train is not None
    return ArrayDataset(
        name=root.name, images=_decode_images([r.file for r in records], cfg.image_size), labels=labels,
        num_classes=len(class_names), class_names=class_names,
        client_ids=np.array([r.client_id for r in records], dtype=np.int64) if has_clients else None,
        is_train=np.array([r.is_train for r in records], dtype=bool) if has_split else None,
    )


# --------------------------------------------------------------------------- user data: Hugging Face datasets

_HF_INSTALL = "pip install 'rayfed_proto[hf]' (or pip install 'datasets>=2.14')"
_HF_SOURCE = ("a folder written by datasets' save_to_disk (data.path) or a dataset on the Hugging Face Hub "
              "(data.hf.hub_name, with data.download: true)")


@register_check("data")
def hf_source_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``data.name: hf`` reads exactly one source: ``data.path`` or ``data.hf.hub_name`` (with
    ``data.download``). Whether ``datasets`` is installed is checked when the data is loaded, by
    the driver only: actors re-validate the config and never read the data."""
    data = cfg.data
    if data.name != "hf":
        return []
    hf = data.hf
    issues = []
    if data.path and hf.hub_name:
        issues.append(ConfigIssue(key="data.hf.hub_name", value=hf.hub_name,
                                  allowed=f"null when data.path is set ({data.path!r}): data.name 'hf' reads one of "
                                  f"{_HF_SOURCE}"))
    elif not data.path and not hf.hub_name:
        issues.append(ConfigIssue(key="data.path", value=None, allowed=f"data.name 'hf' needs {_HF_SOURCE}"))
    if hf.hub_name and not data.path and not data.download:
        issues.append(ConfigIssue(key="data.download", value=False,
                                  allowed=f"true to fetch data.hf.hub_name {hf.hub_name!r} from the Hugging Face Hub "
                                  "(nothing is downloaded otherwise); offline, save it with save_to_disk on a machine "
                                  "with network access and set data.path to that folder"))
    if hf.train_split is not None and hf.train_split == hf.test_split:
        issues.append(ConfigIssue(key="data.hf.test_split", value=hf.test_split,
                                  allowed="a split other than data.hf.train_split"))
    return issues


def _import_hf():
    try:
        import datasets as hf_datasets
    except ImportError as e:
        raise InputError(f"data.name = 'hf' needs the Hugging Face datasets package, which is not installed "
                         f"({e}); install it with {_HF_INSTALL}") from None
    return hf_datasets


def _open_hf(cfg: DataConfig):
    """The ``Dataset`` or ``DatasetDict`` that ``cfg`` names, and a name for it in messages."""
    hf_datasets = _import_hf()
    hub_name = cfg.hf.hub_name
    if cfg.path and hub_name:
        raise ValueError(f"data.hf.hub_name = {hub_name!r} and data.path = {cfg.path!r}: set one, "
                         f"data.name 'hf' reads {_HF_SOURCE}")
    if cfg.path:
        path = _require_path(cfg)
        if not path.exists():
            raise DatasetNotFoundError(f"hf dataset: {path} (data.path) does not exist; expected a folder written by "
                                       "datasets' Dataset.save_to_disk or DatasetDict.save_to_disk")
        try:
            return hf_datasets.load_from_disk(str(path)), str(path)
        except FileNotFoundError as e:  # a folder that save_to_disk did not write
            raise DatasetNotFoundError(f"hf dataset: {path} (data.path) is not a folder written by datasets' "
                                       f"save_to_disk (no dataset_info.json or dataset_dict.json): {e}") from None
    if not hub_name:
        raise ValueError(f"data.name 'hf' needs {_HF_SOURCE}")
    if not cfg.download:
        raise DatasetNotFoundError(f"hf dataset: data.hf.hub_name = {hub_name!r} is fetched from the Hugging Face Hub "
                                   "only with data.download: true; offline, save it with save_to_disk on a machine "
                                   "with network access and set data.path to that folder")
    cache = Path(cfg.root).expanduser().resolve() / "huggingface"
    try:
        return hf_datasets.load_dataset(hub_name, cache_dir=str(cache)), hub_name
    except (OSError, ValueError) as e:  # no network, unknown name (datasets' DatasetNotFoundError is an OSError)
        raise DatasetNotFoundError(f"hf dataset: cannot load {hub_name!r} (data.hf.hub_name) from the Hugging Face "
                                   f"Hub into {cache}: {type(e).__name__}: {e}. Fix: check the name and the network, or "
                                   "save it with save_to_disk where the network is reachable and set data.path to "
                                   "that folder") from None


def _hf_splits(source, cfg: DataConfig, where: str):
    """``(dataset, is_train)``: the train split, then the test split when there is one
    (``is_train`` None without a test split, or with ``data.hf.merge_splits``)."""
    hf_datasets = _import_hf()
    hf = cfg.hf
    if not isinstance(source, hf_datasets.DatasetDict):
        for key in ("train_split", "test_split"):
            if getattr(hf, key) is not None:
                raise ValueError(f"{where}: data.hf.{key} = {getattr(hf, key)!r}, but the dataset has no splits "
                                 "(saved from a Dataset, not a DatasetDict); leave data.hf.train_split and "
                                 "data.hf.test_split unset")
        return source, None
    splits = list(source)
    listed = ", ".join(splits) or "none"
    for key in ("train_split", "test_split"):
        name = getattr(hf, key)
        if name is not None and name not in source:
            raise ValueError(f"{where}: data.hf.{key} = {name!r} is not a split of the dataset; splits: {listed}")
    train = hf.train_split or ("train" if "train" in source else (splits[0] if len(splits) == 1 else None))
    if train is None:
        raise ValueError(f"{where}: the dataset has splits {listed} and none is called 'train'; set "
                         "data.hf.train_split (and data.hf.test_split for a fixed test split)")
    test = hf.test_split or ("test" if "test" in source and train != "test" else None)
    if test is None:
        return source[train], None
    if train == test:
        raise ValueError(f"{where}: data.hf.train_split and data.hf.test_split are both {train!r}")
    try:
        both = hf_datasets.concatenate_datasets([source[train], source[test]])
    except ValueError as e:  # different columns or features
        raise ValueError(f"{where}: splits {train!r} and {test!r} cannot be combined: {e}") from None
    if hf.merge_splits:
        return both, None
    return both, np.arange(len(both)) < len(source[train])


def _hf_column(ds, column: str, key: str, where: str) -> list:
    """The values of ``column`` as a Python list (the other columns, images included, are not decoded)."""
    if column not in ds.column_names:
        raise ValueError(f"{where}: no column {column!r} ({key}); columns: {', '.join(ds.column_names)}")
    values = ds.select_columns([column])[:][column]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ValueError(f"{where}: column {column!r} ({key}) is empty in {len(missing)} rows, the first at row "
                         f"{missing[0]}")
    return values


def _hf_ids(ds, column: str, key: str, where: str) -> tuple[np.ndarray, Optional[list[str]]]:
    """``(ids, names)`` of a label-like column: ClassLabel -> its ids and names; integers (or whole
    floats) -> themselves, names None; strings -> ids in sorted order (``_labels_from_names``)."""
    hf_datasets = _import_hf()
    values = _hf_column(ds, column, key, where)
    feature = ds.features[column]
    if isinstance(feature, hf_datasets.ClassLabel):
        return np.asarray(values, dtype=np.int64), list(feature.names)
    dtype = getattr(feature, "dtype", None) if isinstance(feature, hf_datasets.Value) else None
    if dtype in ("string", "large_string"):
        return _labels_from_names([str(v) for v in values])
    if dtype is None or dtype == "bool":
        raise ValueError(f"{where}: column {column!r} ({key}) holds {feature}; expected a ClassLabel, integers "
                         "or strings")
    return _int_column(np.asarray(values), column, where), None


def _hf_images(ds, column: str, size: int, where: str) -> np.ndarray:
    """(N, C, size, size): an Image feature decoded as the ``folder`` loader does (1 channel when
    every image is grayscale, each resized on its own), or numeric arrays converted as ``npz`` does."""
    hf_datasets = _import_hf()
    key = "data.hf.image_column"
    if column not in ds.column_names:
        raise ValueError(f"{where}: no column {column!r} ({key}); columns: {', '.join(ds.column_names)}")
    feature = ds.features[column]
    if isinstance(feature, hf_datasets.Image):
        raw = _hf_column(ds.cast_column(column, hf_datasets.Image(decode=False)), column, key, where)
        sources: list[Path | bytes] = []
        for i, v in enumerate(raw):  # {"bytes": encoded image or None, "path": file or None}
            if v.get("bytes"):
                sources.append(v["bytes"])
            elif v.get("path") and Path(v["path"]).is_file():
                sources.append(Path(v["path"]))
            else:
                raise DatasetNotFoundError(f"{where}: row {i} of column {column!r} has neither image bytes nor an "
                                           f"existing file (path {v.get('path')!r})")
        return _decode_images(sources, size, describe=lambda i: f"in row {i} of column {column!r} of {where}")
    arrays = ds.select_columns([column]).with_format("numpy")[:][column]
    try:
        images = np.asarray(arrays)
    except ValueError:  # a list of arrays of different shapes (older datasets versions)
        images = np.empty(0, dtype=object)
    if images.dtype == object:
        raise ValueError(f"{where}: column {column!r} ({key}) holds {feature} of different shapes or non-numeric "
                         "values; store images of different sizes as an Image feature (datasets.Image), which is "
                         "resized image by image")
    if images.dtype.kind not in "biuf":
        raise ValueError(f"{where}: column {column!r} ({key}) holds {feature}; expected an Image feature "
                         "(datasets.Image) or numeric arrays of shape (H, W), (H, W, C) or (C, H, W)")
    name = f"column {column!r} ({key})"
    return resize_images(_to_unit_range(_to_nchw(images, where, name), where, name), size)


@DATASETS.register("hf", help="a Hugging Face datasets dataset: a save_to_disk folder at data.path or data.hf.hub_name")
def load_hf(cfg: DataConfig, seed: int) -> ArrayDataset:
    """Load a Hugging Face ``datasets`` dataset; the keys are under ``data.hf``.

    The source is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
    (``data.path``) or, with ``data.download: true``, a Hub dataset (``data.hf.hub_name``). From a
    ``DatasetDict`` the train split (``train_split``, default ``train`` or the only split) and the
    test split (``test_split``, default ``test`` when present) are read; the test split becomes
    ``is_train`` unless ``merge_splits``; other splits are ignored. Labels: a ClassLabel keeps
    its names; integer labels keep their values; string labels become class ids in sorted order
    (all-digit names keep their value, as in ``folder``). ``client_column`` (e.g. a writer id,
    integers or strings) becomes ``client_ids``, the partition of the ``natural`` partitioner.
    """
    source, where = _open_hf(cfg)
    ds, is_train = _hf_splits(source, cfg, where)
    if len(ds) == 0:
        raise ValueError(f"{where}: the dataset has no rows")
    hf = cfg.hf
    labels, names = _hf_ids(ds, hf.label_column, "data.hf.label_column", where)
    if labels.min() < 0:
        first = int(np.argmax(labels < 0))
        raise ValueError(f"{where}: column {hf.label_column!r} (data.hf.label_column) must hold class ids >= 0, found "
                         f"{labels[first]} at row {first} (an unlabelled split? choose the splits with "
                         "data.hf.train_split / data.hf.test_split)")
    num_classes = int(labels.max()) + 1
    if names is not None:
        if num_classes > len(names):
            raise ValueError(f"{where}: column {hf.label_column!r} has labels up to {num_classes - 1} but only "
                             f"{len(names)} class names")
        num_classes = len(names)
    client_ids = None
    if hf.client_column is not None:
        client_ids, _ = _hf_ids(ds, hf.client_column, "data.hf.client_column", where)
    images = _hf_images(ds, hf.image_column, cfg.image_size, where)
    name = Path(where).name if cfg.path else where
    return ArrayDataset(name=name, images=images, labels=labels, num_classes=num_classes, class_names=names or [],
                        client_ids=client_ids, is_train=is_train)
