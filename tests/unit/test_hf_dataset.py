"""``data.name: hf``: Hugging Face ``datasets`` data, read from folders that ``save_to_disk`` writes here.

Every test that reads data writes a small dataset with the real ``datasets`` package
(``Dataset.from_dict`` + ``save_to_disk``) into tmp_path, so the loader runs on the real on-disk
format; no network is used (the Hub path, ``data.hf.hub_name``, has no test).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from PIL import Image

from rayfed_proto.config import ConfigError, DataConfig, InputError, build_config
from rayfed_proto.data import DATASETS, load_dataset, make_partition
from rayfed_proto.data.datasets import DatasetNotFoundError

needs_hf = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                              reason="the Hugging Face datasets package is not installed (pip install 'rayfed_proto[hf]')")

LABELS = ["b", "a", "c", "a", "b", "c", "a", "b"]
WRITERS = [7, 7, 3, 3, 9, 9, 3, 7]
SIZE = 8


def gray_images(n: int, seed: int = 0) -> list[Image.Image]:
    """Grayscale images of two sizes (each is resized on its own)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (10, 12) if i % 2 else (6, 6), dtype=np.uint8), mode="L")
            for i in range(n)]


def expected_pixels(im: Image.Image, mode: str = "L") -> np.ndarray:
    """What the folder loader makes of one image: converted, resized bilinearly, channels first."""
    arr = np.asarray(im.convert(mode).resize((SIZE, SIZE), Image.Resampling.BILINEAR))
    return arr[None] if mode == "L" else arr.transpose(2, 0, 1)


def save(tmp_path, columns: dict, name: str = "hfdata", features=None):
    import datasets

    path = tmp_path / name
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path))
    return path


def cfg(path, **hf) -> DataConfig:
    return DataConfig(name="hf", path=str(path), image_size=SIZE, hf=hf)


def test_hf_is_a_registered_dataset():
    assert "hf" in DATASETS and "save_to_disk" in DATASETS.describe("hf")


@needs_hf
def test_a_saved_dataset_with_string_labels_and_a_writer_column(tmp_path):
    images = gray_images(8)
    path = save(tmp_path, {"image": images, "label": LABELS, "writer": WRITERS})
    ds = load_dataset(cfg(path, client_column="writer"))
    assert ds.name == "hfdata" and ds.images.shape == (8, 1, SIZE, SIZE) and ds.images.dtype == np.uint8
    assert ds.class_names == ["a", "b", "c"] and ds.num_classes == 3  # sorted
    assert ds.labels.tolist() == [["a", "b", "c"].index(v) for v in LABELS]
    assert ds.client_ids.tolist() == WRITERS and ds.is_train is None
    for i in (0, 1):  # the folder loader's decoding: PNG round trip is lossless
        np.testing.assert_array_equal(ds.images[i], expected_pixels(images[i]))

    plain = load_dataset(cfg(path))
    assert plain.client_ids is None


@needs_hf
def test_natural_partition_from_the_client_column_via_the_config(tmp_path):
    path = save(tmp_path, {"image": gray_images(8), "label": LABELS, "writer": [str(w) for w in WRITERS]})
    config = build_config(None, ["data.name=hf", f"data.path={path}", "data.image_size=8",
                                 "data.hf.client_column=writer", "data.partition.name=natural",
                                 "federation.num_clients=3", "data.test_fraction=0.3"])
    ds = load_dataset(config.data, config.seed)
    part = make_partition(ds, config.data.partition, config.federation.num_clients, config.seed,
                          test_fraction=config.data.test_fraction)
    owners = {w: sorted(i for i, x in enumerate(WRITERS) if x == w) for w in sorted(set(WRITERS))}
    assert [sorted(np.concatenate([c.train_idx, c.test_idx]).tolist()) for c in part.clients] == list(owners.values())


@needs_hf
def test_a_dataset_dict_gives_is_train_and_class_label_names(tmp_path):
    import datasets

    features = datasets.Features({"img": datasets.Image(), "digit": datasets.ClassLabel(names=["zero", "one", "two"]),
                                  "writer": datasets.Value("int64")})

    def split(n, seed):
        return datasets.Dataset.from_dict({"img": gray_images(n, seed), "digit": [i % 3 for i in range(n)],
                                           "writer": [i % 2 for i in range(n)]}, features=features)

    datasets.DatasetDict({"train": split(6, 0), "validation": split(2, 1), "test": split(3, 2)}).save_to_disk(
        str(tmp_path / "dd"))
    ds = load_dataset(cfg(tmp_path / "dd", image_column="img", label_column="digit", client_column="writer"))
    assert ds.images.shape == (9, 1, SIZE, SIZE)  # train + test; validation is not read
    assert ds.is_train.tolist() == [True] * 6 + [False] * 3
    assert ds.class_names == ["zero", "one", "two"] and ds.labels.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert ds.client_ids.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 0]

    part = make_partition(ds, DataConfig(partition={"name": "natural"}).partition, 2, seed=0)
    for client in part.clients:  # the fixed split replaces the stratified one
        assert ds.is_train[client.train_idx].all() and not ds.is_train[client.test_idx].any()

    merged = load_dataset(cfg(tmp_path / "dd", image_column="img", label_column="digit", merge_splits=True))
    assert len(merged) == 9 and merged.is_train is None
    chosen = load_dataset(cfg(tmp_path / "dd", image_column="img", label_column="digit", train_split="validation"))
    assert chosen.is_train.tolist() == [True] * 2 + [False] * 3
    alone = load_dataset(cfg(tmp_path / "dd", image_column="img", label_column="digit", train_split="train",
                             test_split="validation"))
    assert len(alone) == 8


@needs_hf
def test_a_single_split_without_test_is_read_whole(tmp_path):
    import datasets

    one = datasets.Dataset.from_dict({"image": gray_images(4), "label": [0, 1, 1, 0]})
    datasets.DatasetDict({"everything": one}).save_to_disk(str(tmp_path / "one"))
    ds = load_dataset(cfg(tmp_path / "one"))
    assert len(ds) == 4 and ds.is_train is None and ds.class_names == ["0", "1"]


@needs_hf
def test_color_images_and_integer_labels(tmp_path):
    rng = np.random.default_rng(1)
    images = gray_images(2) + [Image.fromarray(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8), mode="RGB")]
    path = save(tmp_path, {"image": images, "label": [0, 4, 2]})
    ds = load_dataset(cfg(path))
    assert ds.images.shape == (3, 3, SIZE, SIZE)  # one color image: every image becomes RGB, as in folder
    np.testing.assert_array_equal(ds.images[0], expected_pixels(images[0], "RGB"))
    assert ds.labels.tolist() == [0, 4, 2] and ds.num_classes == 5


@needs_hf
def test_array_images_are_converted_like_npz(tmp_path):
    rng = np.random.default_rng(2)
    hwc = rng.random((4, 5, 5, 3)).astype(np.float32)
    path = save(tmp_path, {"pixels": list(hwc), "label": ["1", "0", "1", "2"]})
    ds = load_dataset(DataConfig(name="hf", path=str(path), image_size=5, hf={"image_column": "pixels"}))
    assert ds.images.shape == (4, 3, 5, 5) and ds.images.dtype == np.float32
    np.testing.assert_allclose(ds.images, hwc.transpose(0, 3, 1, 2))
    assert ds.labels.tolist() == [1, 0, 1, 2] and ds.class_names == ["0", "1", "2"]  # digit names keep their value
    assert load_dataset(cfg(path, image_column="pixels")).images.shape == (4, 3, SIZE, SIZE)

    ragged = save(tmp_path, {"pixels": [np.zeros((4, 4)), np.zeros((5, 5))], "label": [0, 1]}, name="ragged")
    with pytest.raises(ValueError, match=r"column 'pixels' \(data.hf.image_column\) holds .* of different shapes"):
        load_dataset(cfg(ragged, image_column="pixels"))
    wide = save(tmp_path, {"pixels": [np.full((4, 4), 300)], "label": [0]}, name="wide")
    with pytest.raises(ValueError, match=r"integer column 'pixels' \(data.hf.image_column\) must be in 0..255"):
        load_dataset(cfg(wide, image_column="pixels"))


@needs_hf
def test_errors_name_the_key_the_value_and_what_is_allowed(tmp_path):
    path = save(tmp_path, {"image": gray_images(3), "label": ["a", "b", "a"], "ok": [True, False, True],
                           "name": ["x", "y", "z"]})
    with pytest.raises(ValueError, match=r"hfdata: no column 'digit' \(data.hf.label_column\); "
                                         r"columns: image, label, ok, name"):
        load_dataset(cfg(path, label_column="digit"))
    with pytest.raises(ValueError, match=r"no column 'img' \(data.hf.image_column\); columns: image, label, ok, name"):
        load_dataset(cfg(path, image_column="img"))
    with pytest.raises(ValueError, match=r"no column 'writer' \(data.hf.client_column\)"):
        load_dataset(cfg(path, client_column="writer"))
    with pytest.raises(ValueError, match=r"column 'ok' \(data.hf.label_column\) holds Value\('bool'\); expected a "
                                         r"ClassLabel, integers or strings"):
        load_dataset(cfg(path, label_column="ok"))
    with pytest.raises(ValueError, match=r"column 'name' \(data.hf.image_column\) holds Value\('string'\)"):
        load_dataset(cfg(path, image_column="name"))
    with pytest.raises(ValueError, match="the dataset has no splits .* leave data.hf.train_split"):
        load_dataset(cfg(path, train_split="train"))

    negative = save(tmp_path, {"image": gray_images(2), "label": [0, -1]}, name="neg")
    with pytest.raises(ValueError, match=r"must hold class ids >= 0, found -1 at row 1"):
        load_dataset(cfg(negative))
    gaps = save(tmp_path, {"image": gray_images(2), "label": ["a", None]}, name="gaps")
    with pytest.raises(ValueError, match=r"column 'label' \(data.hf.label_column\) is empty in 1 rows, the first at row 1"):
        load_dataset(cfg(gaps))
    fractional = save(tmp_path, {"image": gray_images(2), "label": [0.0, 1.5]}, name="frac")
    with pytest.raises(ValueError, match=r"'label' must be whole numbers .* found 1.5 at index 1"):
        load_dataset(cfg(fractional))


@needs_hf
def test_split_errors_list_the_splits(tmp_path):
    import datasets

    part = datasets.Dataset.from_dict({"image": gray_images(2), "label": [0, 1]})
    datasets.DatasetDict({"a": part, "b": part}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ValueError, match="the dataset has splits a, b and none is called 'train'; set data.hf.train_split"):
        load_dataset(cfg(tmp_path / "ab"))
    with pytest.raises(ValueError, match=r"data.hf.test_split = 'test' is not a split of the dataset; splits: a, b"):
        load_dataset(cfg(tmp_path / "ab", train_split="a", test_split="test"))
    assert load_dataset(cfg(tmp_path / "ab", train_split="b")).is_train is None


@needs_hf
def test_paths_that_are_not_saved_datasets(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"hf dataset: .*missing \(data.path\) does not exist"):
        load_dataset(cfg(tmp_path / "missing"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.png").write_bytes(b"")
    with pytest.raises(DatasetNotFoundError, match=r"plain \(data.path\) is not a folder written by datasets' save_to_disk"):
        load_dataset(cfg(tmp_path / "plain"))


def test_config_checks_of_the_source():
    def keys(overrides):
        with pytest.raises(ConfigError) as err:
            build_config(None, ["data.name=hf", *overrides])
        return {i.key: i.allowed for i in err.value.issues}

    assert "data.path" in keys([])
    both = keys(["data.path=x", "data.hf.hub_name=org/set"])
    assert "null when data.path is set" in both["data.hf.hub_name"]
    hub = keys(["data.hf.hub_name=org/set"])
    assert set(hub) == {"data.download"} and "save_to_disk" in hub["data.download"]
    assert "data.hf.test_split" in keys(["data.path=x", "data.hf.train_split=a", "data.hf.test_split=a"])
    assert "data.hf.image_colum" in keys(["data.path=x", "data.hf.image_colum=img"])  # typo: extra keys are refused
    build_config(None, ["data.name=hf", "data.hf.hub_name=org/set", "data.download=true"])
    build_config(None, ["data.name=digits", "data.hf.hub_name=org/set"])  # ignored by the other loaders


def test_without_the_datasets_package_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(InputError, match=r"data.name = 'hf' needs the Hugging Face datasets package, which is not "
                                         r"installed .*pip install 'rayfed_proto\[hf\]'"):
        load_dataset(cfg(tmp_path))
