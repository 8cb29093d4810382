"""Loadable models: ``mlflow.pytorch.log_model`` of the server's model and/or client models.

``tracking.log_models``:

* ``auto`` (default): the server's model when the method has one (FedAvg, FedProtoKD...),
  otherwise one client per architecture;
* ``server``, ``per_architecture`` (the lowest client id of each architecture), ``all`` (every
  client: one model per client, sized for small federations), ``none``.

Each model is logged at the end of the run under the name ``server`` or ``client_<id>``, with an
input example (two test images, normalised as the clients see them) so MLflow infers the
signature, and with ``rayfed_proto`` itself as a code path, so ``mlflow.pytorch.load_model`` works
where the package is not installed. The model of a client is the one its final evaluation scores
(its weights after taking in the final broadcast), and the accuracy that this export measures is
logged linked to the model: ``model/client_<id>/head_acc`` (``proto_acc``, ``test_samples``) on the
client's test split, ``model/server/global_acc`` on the global test set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def choose_models(choice: str, has_server_model: bool, archs: list[str]) -> tuple[bool, list[int]]:
    """(log the server's model, client ids to log) for ``tracking.log_models``; ``archs[i]`` is client i's."""
    if choice == "none":
        return False, []
    if choice == "auto":
        choice = "server" if has_server_model else "per_architecture"
    if choice == "server":
        return has_server_model, []
    if choice == "all":
        return False, list(range(len(archs)))
    first: dict[str, int] = {}
    for c, a in enumerate(archs):
        first.setdefault(a, c)
    return False, sorted(first.values())


def pip_requirements() -> list[str]:
    """Pinned explicitly: MLflow's own inference loads the model in a subprocess (slow, per model)."""
    from importlib.metadata import version

    return [f"{p}=={version(p)}" for p in ("torch", "numpy", "cloudpickle")]


def log_pytorch_model(tracker, model, name: str, input_example: np.ndarray, metrics: dict[str, float], step: int,
                      dataset=None, tags: dict[str, Any] | None = None) -> str | None:
    """Log ``model`` (a CPU module in eval mode) and ``metrics`` linked to it (``model/<name>/<key>``);
    returns the model id."""
    import rayfed_proto
    from rayfed_proto.tracking.metric_names import model_metric

    model_id = tracker.log_model(model, name, input_example=input_example, pip_requirements=pip_requirements(),
                                 code_paths=[str(Path(rayfed_proto.__file__).resolve().parent)], step=step,
                                 tags={k: str(v) for k, v in (tags or {}).items()})
    if model_id is not None and metrics:
        tracker.log_metrics({model_metric(name, k): v for k, v in metrics.items()}, step=step, model_id=model_id,
                            dataset=dataset)
    return model_id
