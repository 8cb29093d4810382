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
client's test split, ``model/server/global_acc`` on the global test set. No other metric of the run
is linked to a model (:meth:`rayfed_proto.tracking.mlflow_tracker.MlflowTracker.log_model`).

Format: ``serialization_format="pickle"`` (``torch.save`` of the module), so that
``mlflow.pytorch.load_model`` gives back the ``ProtoModel`` itself, an ``nn.Module`` with
``.eval()``, ``.features()`` and a forward pass. MLflow 3's default outside Databricks, ``pt2``
(``torch.export``), gives a ``torch.fx`` GraphModule that has no ``.eval()`` and only the traced
forward, and warns at export about the channels_last weights. Unpickling imports
``rayfed_proto.models`` (the code path logged with the model provides it) and, as any pickle,
runs code from the file: load models only from a store you trust. The model logged is a contiguous
(NCHW) CPU copy: ``training.memory_format`` may keep convolution weights channels_last, a layout
that is a training-speed choice of this package, not part of the model.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np

SERIALIZATION_FORMAT = "pickle"  # a real nn.Module on load; "pt2" gives a torch.fx GraphModule (module docstring)


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


def loadable_copy(model):
    """A CPU copy of ``model`` in eval mode whose parameters and buffers are all contiguous (NCHW for
    convolution weights, whatever ``training.memory_format`` made them); ``model`` is left as it is."""
    out = copy.deepcopy(model).cpu().eval()
    for t in itertools.chain(out.parameters(), out.buffers()):
        if not t.is_contiguous():
            t.data = t.data.contiguous()
    return out


def format_kwargs() -> dict[str, str]:
    """``serialization_format="pickle"`` for ``mlflow.pytorch.log_model``; nothing where MLflow does not
    know the option yet (the MLflow 3 releases before it pickle by default)."""
    import inspect

    import mlflow.pytorch

    if "serialization_format" in inspect.signature(mlflow.pytorch.log_model).parameters:
        return {"serialization_format": SERIALIZATION_FORMAT}
    return {}


def log_pytorch_model(tracker, model, name: str, input_example: np.ndarray, metrics: dict[str, float], step: int,
                      dataset=None, tags: dict[str, Any] | None = None) -> str | None:
    """Log a :func:`loadable_copy` of ``model`` in the pickle format, and ``metrics`` linked to it alone
    (``model/<name>/<key>``); returns the model id."""
    import rayfed_proto
    from rayfed_proto.tracking.metric_names import model_metric

    model_id = tracker.log_model(loadable_copy(model), name, step=step, tags={k: str(v) for k, v in (tags or {}).items()},
                                 input_example=input_example, pip_requirements=pip_requirements(),
                                 code_paths=[str(Path(rayfed_proto.__file__).resolve().parent)], **format_kwargs())
    if model_id is not None and metrics:
        tracker.log_metrics({model_metric(name, k): v for k, v in metrics.items()}, step=step, model_id=model_id,
                            dataset=dataset)
    return model_id
