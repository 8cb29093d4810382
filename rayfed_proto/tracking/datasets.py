"""What a run used, as MLflow datasets (the run page's "Datasets" panel) and the partition table.

Each input is a small pandas frame of *indices into the dataset* (sample_index, client_id, label,
domain), not the images: the images live where the loader reads them, and the split is what
differs between runs. The inputs:

* ``<dataset>`` (context ``source``): every sample's label; digest = md5 of the images and labels,
  so two runs on the same data show the same digest;
* ``<dataset>/train``, ``<dataset>/test`` (contexts ``training``, ``testing``): the clients' splits;
* ``<dataset>/global_test``, ``<dataset>/public`` (contexts ``global_test``, ``public``), when the
  run holds them out.

Split digests are md5s of the index columns, so they change exactly when the partition does.
The per-client partition table (samples per class) is logged as ``tables/partition.json``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np
import pandas as pd

CONTEXTS = {"train": "training", "test": "testing", "global_test": "global_test", "public": "public"}


def _md5(*arrays: np.ndarray) -> str:
    h = hashlib.md5()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:8]  # MLflow's own digests are 8 hex characters


def split_frames(partition, labels: np.ndarray, domains: Optional[np.ndarray] = None) -> dict[str, pd.DataFrame]:
    """One frame per non-empty split: sample_index, client_id (-1: held by the server), label (, domain)."""
    parts: dict[str, list[tuple[int, np.ndarray]]] = {"train": [], "test": []}
    for c in partition.clients:
        parts["train"].append((c.client_id, np.asarray(c.train_idx, dtype=np.int64)))
        parts["test"].append((c.client_id, np.asarray(c.test_idx, dtype=np.int64)))
    parts["global_test"] = [(-1, partition.global_test_idx)]
    parts["public"] = [(-1, partition.public_idx)]
    out = {}
    for split, groups in parts.items():
        idx = np.concatenate([i for _, i in groups]) if groups else np.empty(0, np.int64)
        if len(idx) == 0:
            continue
        frame = pd.DataFrame({"sample_index": idx,
                              "client_id": np.concatenate([np.full(len(i), c, np.int32) for c, i in groups]),
                              "label": labels[idx]})
        if domains is not None:
            frame["domain"] = domains[idx]
        out[split] = frame
    return out


def mlflow_datasets(dataset, partition, cfg) -> tuple[list[Any], list[str]]:
    """(datasets, contexts) for ``mlflow.log_inputs``: the whole dataset, then each split."""
    import warnings

    with warnings.catch_warnings():  # "inferred schema contains integer column(s)": indices and labels are never missing
        warnings.simplefilter("ignore", UserWarning)
        return _mlflow_datasets(dataset, partition, cfg)


def _mlflow_datasets(dataset, partition, cfg) -> tuple[list[Any], list[str]]:
    import mlflow.data
    from mlflow.data.code_dataset_source import CodeDatasetSource

    labels = np.asarray(dataset.labels)
    domains = getattr(dataset, "domains", None)
    where = {"loader": f"rayfed_proto.data.load_dataset (data.name={cfg.data.name})", "data.root": str(cfg.data.root)}
    if cfg.data.path:
        where["data.path"] = str(cfg.data.path)
    whole = pd.DataFrame({"sample_index": np.arange(len(labels)), "label": labels})
    if domains is not None:
        whole["domain"] = domains
    datasets = [mlflow.data.from_pandas(whole, source=CodeDatasetSource(tags=where), targets="label", name=dataset.name,
                                        digest=_md5(dataset.images, labels))]
    contexts = ["source"]
    for split, frame in split_frames(partition, labels, domains).items():
        source = CodeDatasetSource(tags={**where, "partition": f"{cfg.data.partition.name} (seed {cfg.seed})",
                                         "split": split})
        datasets.append(mlflow.data.from_pandas(frame, source=source, targets="label", name=f"{dataset.name}/{split}",
                                                digest=_md5(frame["sample_index"].to_numpy(), frame["client_id"].to_numpy())))
        contexts.append(CONTEXTS[split])
    return datasets, contexts


def partition_table(partition, class_names, archs=None) -> pd.DataFrame:
    """Per client: architecture, train/test samples, and train samples of each class."""
    train, test = partition.label_counts("train"), partition.label_counts("test")
    rows = []
    for c in range(len(partition.clients)):
        row: dict[str, Any] = {"client_id": c}
        if archs is not None:
            row["architecture"] = archs[c]
        row.update({"train_samples": int(train[c].sum()), "test_samples": int(test[c].sum()),
                    "classes_present": int((train[c] > 0).sum())})
        row.update({f"train_{name}": int(n) for name, n in zip(class_names, train[c], strict=True)})
        rows.append(row)
    return pd.DataFrame(rows)
