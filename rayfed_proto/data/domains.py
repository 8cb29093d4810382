"""Multi-domain datasets: every sample carries the index of its domain (``ArrayDataset.domains``).

Each loader is registered in ``DATASETS`` like the single-domain ones and returns 3-channel
images of side ``cfg.image_size`` (grayscale domains are replicated to RGB), so one model
takes every domain. ``cfg.domains`` selects domains (None: all, in the order below); the
dataset's domain order, which ``data.partition.clients_per_domain`` follows, is the order of
``cfg.domains`` as written. Only the selected domains are read from disk.

* ``digits_domains``: embedded, no download. scikit-learn's 1,797 8x8 digits, split into five
  disjoint class-stratified parts, one per domain, each with a fixed transformation:
  ``original``, ``inverted``, ``rotated``, ``noisy``, ``tinted``.
* ``multidigits``: FedLSA's Digits: ``mnist``, ``usps``, ``svhn`` (torchvision files, downloaded
  with ``data.download``) and ``synth`` (SynthDigits, an image folder).
* ``office_caltech10`` (``amazon``, ``caltech``, ``dslr``, ``webcam``) and ``pacs``
  (``art_painting``, ``cartoon``, ``photo``, ``sketch``): image folders
  ``<root>/<dataset dir>/<domain>/<class>/<image>``.

As for the torchvision sets, each domain's official train and test splits are merged: the
whole domain is partitioned over clients (``by_domain``) and split per client.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Optional

import numpy as np

from rayfed_proto.config import DataConfig
from rayfed_proto.data import DATASETS
from rayfed_proto.data.base import ArrayDataset
from rayfed_proto.data.datasets import (
    DatasetNotFoundError,
    _decode_images,
    _is_image,
    _scan_directories,
    _subdirs,
    open_torchvision,
    resize_images,
)


def select_domains(cfg: DataConfig, dataset: str, allowed: list[str]) -> list[str]:
    """The domains to load: ``cfg.domains`` checked against ``allowed``, or all of them."""
    if cfg.domains is None:
        return list(allowed)
    chosen = list(cfg.domains)
    unknown = [d for d in chosen if d not in allowed]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        problem = (f"unknown domain(s) {', '.join(map(repr, unknown))}" if unknown
                   else "no domain" if not chosen else "a domain is listed twice")
        raise ValueError(f"data.domains = {chosen}: {problem} for dataset {dataset!r}; "
                         f"allowed (each at most once): {', '.join(allowed)}")
    return chosen


def _to_rgb(images: np.ndarray) -> np.ndarray:
    return np.repeat(images, 3, axis=1) if images.shape[1] == 1 else images


def _combine(name: str, parts: list[tuple[np.ndarray, np.ndarray]], domain_names: list[str],
             class_names: list[str]) -> ArrayDataset:
    """One dataset from per-domain (images, labels), in ``domain_names`` order."""
    dtypes = {p[0].dtype for p in parts}
    if len(dtypes) > 1:  # uint8 and float domains: bring all to float in [0, 1]
        parts = [(ArrayDataset._float(x), y) for x, y in parts]
    images = np.concatenate([_to_rgb(x) for x, _ in parts])
    labels = np.concatenate([np.asarray(y, dtype=np.int64) for _, y in parts])
    domains = np.concatenate([np.full(len(y), d, dtype=np.int64) for d, (_, y) in enumerate(parts)])
    return ArrayDataset(name=name, images=images, labels=labels, num_classes=len(class_names),
                        class_names=class_names, domains=domains, domain_names=list(domain_names))


# --------------------------------------------------------------------------- digits_domains

DIGITS_DOMAINS = ["original", "inverted", "rotated", "noisy", "tinted"]
# The split of the 1,797 images into domains is fixed (not the run's seed): the dataset is
# the same in every run, like a downloaded one; the run's seed drives the partition.
_DIGITS_DOMAINS_SEED = 20240601
_DIGITS_NOISE_STD = 0.3
_DIGITS_TINT = (1.0, 0.55, 0.1)  # orange: R, G, B multipliers


def digits_domain_split(labels: np.ndarray, num_domains: int, seed: int = _DIGITS_DOMAINS_SEED) -> np.ndarray:
    """(N,) domain of each image: per class, a seeded permutation dealt round-robin over domains.

    Every image is in exactly one domain, and each class is spread evenly over the domains
    (counts differ by at most one).
    """
    rng = np.random.default_rng(seed)
    out = np.empty(len(labels), dtype=np.int64)
    offset = 0
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        # round-robin continues across classes, so no domain gets every class's remainder
        out[members] = (np.arange(len(members)) + offset) % num_domains
        offset += len(members)
    return out


def _digits_transform(domain: str, x: np.ndarray) -> np.ndarray:
    """(n, 1, S, S) float images in [0, 1] -> (n, 3, S, S), the domain's fixed transformation."""
    rgb = np.repeat(x, 3, axis=1)
    if domain == "original":
        return rgb
    if domain == "inverted":
        return 1.0 - rgb
    if domain == "rotated":  # 90 degrees counter-clockwise: exact, no interpolation
        return np.ascontiguousarray(np.rot90(rgb, k=1, axes=(2, 3)))
    if domain == "noisy":  # fixed-seed Gaussian pixel noise, the same at every load
        noise = np.random.default_rng(_DIGITS_DOMAINS_SEED + 1).standard_normal(x.shape, dtype=np.float32)
        return np.repeat(np.clip(x + _DIGITS_NOISE_STD * noise, 0.0, 1.0), 3, axis=1)
    if domain == "tinted":
        return rgb * np.asarray(_DIGITS_TINT, dtype=np.float32).reshape(1, 3, 1, 1)
    raise AssertionError(domain)


@DATASETS.register("digits_domains", help="embedded multi-domain digits: 5 disjoint parts, fixed transforms (offline)")
def load_digits_domains(cfg: DataConfig, seed: int) -> ArrayDataset:
    """scikit-learn's digits as five domains of about 360 images each (disjoint, class-stratified).

    ``original`` (gray replicated to RGB), ``inverted`` (1 - x), ``rotated`` (90 degrees
    counter-clockwise), ``noisy`` (Gaussian noise, std 0.3, fixed seed, clipped), ``tinted``
    (RGB multiplied by (1.0, 0.55, 0.1)). The transforms are applied after resizing to
    ``cfg.image_size``; images are float32 in [0, 1].
    """
    from rayfed_proto.data.datasets import digits_arrays

    chosen = select_domains(cfg, "digits_domains", DIGITS_DOMAINS)
    digits, target = digits_arrays()
    images = resize_images((digits.astype(np.float32) / 16.0)[:, None], cfg.image_size)
    labels = target.astype(np.int64)
    assignment = digits_domain_split(labels, len(DIGITS_DOMAINS))
    parts = []
    for domain in chosen:
        members = np.flatnonzero(assignment == DIGITS_DOMAINS.index(domain))
        parts.append((_digits_transform(domain, images[members]).astype(np.float32), labels[members]))
    return _combine("digits_domains", parts, chosen, [str(d) for d in range(10)])


# --------------------------------------------------------------------------- multidigits

MULTIDIGITS_DOMAINS = ["mnist", "usps", "svhn", "synth"]
_SYNTH_DIR = "SynthDigits"
MULTIDIGITS_LAYOUT = {
    "mnist": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    "usps": "USPS/{usps.bz2,usps.t.bz2}",
    "svhn": "SVHN/{train_32x32.mat,test_32x32.mat}",
    "synth": f"{_SYNTH_DIR}/{{train,test}}/<0..9>/<image> (or {_SYNTH_DIR}/<0..9>/<image>)",
}


def _torchvision_domain(domain: str, root: Path, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, C, H, W) uint8, labels) of a torchvision domain, official train then test."""
    if domain == "mnist":
        splits = open_torchvision("multidigits domain 'mnist'", "MNIST", root, MULTIDIGITS_LAYOUT["mnist"], download,
                                  [{"train": True}, {"train": False}])
    elif domain == "usps":
        splits = open_torchvision("multidigits domain 'usps'", "USPS", root / "USPS", "{usps.bz2,usps.t.bz2}", download,
                                  [{"train": True}, {"train": False}])
    else:
        splits = open_torchvision("multidigits domain 'svhn'", "SVHN", root / "SVHN",
                                  "{train_32x32.mat,test_32x32.mat}", download, [{"split": "train"}, {"split": "test"}])
    images, labels = [], []
    for ds in splits:
        data = np.asarray(ds.data)  # MNIST, USPS: (N, H, W); SVHN: (N, 3, H, W)
        images.append(data[:, None] if data.ndim == 3 else data)
        labels.append(np.asarray(ds.labels if domain == "svhn" else ds.targets, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def _synth_digits(root: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    folder = root / _SYNTH_DIR
    where = f"{root}/{MULTIDIGITS_LAYOUT['synth']}"
    if not folder.is_dir():
        raise DatasetNotFoundError(f"multidigits domain 'synth': directory {folder} does not exist (SynthDigits is "
                                   f"not downloaded automatically); expected {where}")
    records = _scan_directories(folder)
    if not records:
        raise DatasetNotFoundError(f"multidigits domain 'synth': no images found in {folder}; expected {where}")
    if records[0].client_id is not None or any(not re.fullmatch(r"[0-9]", r.label) for r in records):
        raise ValueError(f"multidigits domain 'synth': class directories must be named 0..9; expected {where}")
    labels = np.array([int(r.label) for r in records], dtype=np.int64)
    return _decode_images([r.file for r in records], size), labels


@DATASETS.register("multidigits", help="FedLSA's Digits: mnist, usps, svhn (torchvision) and synth (SynthDigits folder)")
def load_multidigits(cfg: DataConfig, seed: int) -> ArrayDataset:
    """MNIST, USPS, SVHN and SynthDigits as four domains of 3-channel images (train+test merged).

    The whole of each domain is used (FedLSA reports 203,587 images for the four, i.e.
    MNIST 70,000 + USPS 9,298 + SVHN 99,289 (train+test, not "extra") + SynthDigits
    25,000; it gives no subsampling in the paper itself).
    """
    chosen = select_domains(cfg, "multidigits", MULTIDIGITS_DOMAINS)
    root = Path(cfg.root).expanduser().resolve()
    parts = []
    for domain in chosen:
        if domain == "synth":
            parts.append(_synth_digits(root, cfg.image_size))
        else:
            images, labels = _torchvision_domain(domain, root, cfg.download)
            parts.append((resize_images(images, cfg.image_size), labels))
    return _combine("multidigits", parts, chosen, [str(d) for d in range(10)])


# --------------------------------------------------------------------------- image-folder sets


def _load_domain_folders(cfg: DataConfig, name: str, dirs: list[str], all_domains: list[str]) -> ArrayDataset:
    """``<root>/<dir>/<domain>/<class>/<image>``, ``dir`` the first of ``dirs`` holding a domain."""
    chosen = select_domains(cfg, name, all_domains)
    root = Path(cfg.root).expanduser().resolve()
    layout = (f"{root}/{dirs[0]}/<domain>/<class>/<image> with domain directories {', '.join(all_domains)}"
              + (f" (also accepted: {', '.join(f'{root}/{d}/<domain>/...' for d in dirs[1:])})" if dirs[1:] else ""))
    # the first candidate holding a chosen domain's directory, else the first that exists
    base: Optional[Path] = next((root / d for d in dirs if any((root / d / x).is_dir() for x in chosen)),
                                next((root / d for d in dirs if (root / d).is_dir()), None))
    if base is None:
        raise DatasetNotFoundError(f"{name}: dataset directory not found under {root} (it is not downloaded "
                                   f"automatically); expected {layout}")
    files: dict[str, list[tuple[Path, str]]] = {}
    for domain in chosen:
        ddir = base / domain
        if not ddir.is_dir():
            raise DatasetNotFoundError(f"{name}: domain directory {ddir} does not exist; expected {layout}")
        files[domain] = [(f, c.name) for c in _subdirs(ddir) for f in sorted(c.rglob("*")) if _is_image(f)]
        if not files[domain]:
            raise DatasetNotFoundError(f"{name}: no images found in {ddir}; expected {layout}")
    class_sets = {d: {c for _, c in fs} for d, fs in files.items()}
    class_names = sorted(set().union(*class_sets.values()))
    missing = {d: sorted(set(class_names) - s) for d, s in class_sets.items() if s != set(class_names)}
    if missing:
        warnings.warn(f"{name}: some domains lack classes that others have: {missing}", stacklevel=3)
    lookup = {c: i for i, c in enumerate(class_names)}
    parts = [(_to_rgb(_decode_images([f for f, _ in files[d]], cfg.image_size)),
              np.array([lookup[c] for _, c in files[d]], dtype=np.int64)) for d in chosen]
    return _combine(name, parts, chosen, class_names)


OFFICE_CALTECH10_DOMAINS = ["amazon", "caltech", "dslr", "webcam"]
OFFICE_CALTECH10_DIRS = ["office_caltech_10"]
PACS_DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]
PACS_DIRS = ["PACS", "PACS/kfold"]  # kfold/: the official release's image folder


@DATASETS.register("office_caltech10", help="Office-Caltech-10 image folders: amazon, caltech, dslr, webcam (10 classes)")
def load_office_caltech10(cfg: DataConfig, seed: int) -> ArrayDataset:
    """``<root>/office_caltech_10/<domain>/<class>/<image>``; classes sorted by name (10)."""
    return _load_domain_folders(cfg, "office_caltech10", OFFICE_CALTECH10_DIRS, OFFICE_CALTECH10_DOMAINS)


@DATASETS.register("pacs", help="PACS image folders: art_painting, cartoon, photo, sketch (7 classes)")
def load_pacs(cfg: DataConfig, seed: int) -> ArrayDataset:
    """``<root>/PACS/<domain>/<class>/<image>`` (or ``<root>/PACS/kfold/...``); classes sorted by name (7)."""
    return _load_domain_folders(cfg, "pacs", PACS_DIRS, PACS_DOMAINS)


# dataset name -> its domains, in the default order (what data.domains may list)
DOMAIN_NAMES: dict[str, list[str]] = {
    "digits_domains": DIGITS_DOMAINS, "multidigits": MULTIDIGITS_DOMAINS,
    "office_caltech10": OFFICE_CALTECH10_DOMAINS, "pacs": PACS_DOMAINS,
}
