"""Loadable models: ``mlflow.pytorch.log_model`` of the server's model and/or client models.

``tracking.log_models``:

* ``auto`` (default): the server's model when the method has one (FedAvg, FedProtoKD...),
  otherwise one client per architecture;
* ``server``, ``per_architecture`` (one client of each architecture: :func:`pick_per_architecture`),
  ``all`` (every client: one model per client, sized for small federations), ``none``.

The client of an architecture is one that trained: the one with the most local updates, ties
broken by the final accuracy on its own test split, then by the lower id (never a client that was
never picked: with partial participation the lowest id may have 0 updates and chance accuracy).
Why it was chosen is the model's description (its ``mlflow.note.content`` tag) and its tag
``rayfed_proto.chosen_because``.

Each model is logged at the end of the run under the name ``server`` or ``client_<id>``, with an
input example (two test images, normalised as the clients see them) so MLflow infers the
signature, and with ``rayfed_proto`` itself as a code path, so ``mlflow.pytorch.load_model`` works
where the package is not installed. The model of a client is the one its final evaluation scores
(its weights after taking in the final broadcast), and the accuracy that this export measures is
a param of the logged model (``head_acc``, ``proto_acc`` on the client's test split, whose size is
its tag ``test_samples``; ``global_acc`` on the global test set; the split: ``eval_split``) and is
listed in the run's description. It is no run metric: one value per model made one single-dot
chart each (``model/client_<id>/...``, issue 49), and no run metric is linked to a model
(:meth:`rayfed_proto.tracking.mlflow_tracker.MlflowTracker.log_model`). The model is an output of
the run at its final version, never an input.

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


def choose_models(choice: str, has_server_model: bool, archs: list[str], updates: dict[int, int] | None = None,
                  accuracy: dict[int, float] | None = None) -> tuple[bool, dict[int, str]]:
    """(log the server's model, {client id: why it is logged}) for ``tracking.log_models``;
    ``archs[i]`` is client i's architecture, ``updates[i]`` its local updates in the run,
    ``accuracy[i]`` its final head accuracy on its own test split (both may miss clients)."""
    if choice == "none":
        return False, {}
    if choice == "auto":
        choice = "server" if has_server_model else "per_architecture"
    if choice == "server":
        return has_server_model, {}
    if choice == "all":
        return False, {c: "tracking.log_models: all" for c in range(len(archs))}
    return False, pick_per_architecture(archs, updates or {}, accuracy or {})


def pick_per_architecture(archs: list[str], updates: dict[int, int], accuracy: dict[int, float]) -> dict[int, str]:
    """One client per architecture, {client id: why}: the most local updates, then the best final
    accuracy on its test split, then the lowest id."""
    def score(c: int) -> tuple[int, float, int]:
        acc = accuracy.get(c, float("nan"))
        return updates.get(c, 0), acc if acc == acc else -1.0, -c

    chosen: dict[int, str] = {}
    for arch in dict.fromkeys(archs):
        members = [c for c, a in enumerate(archs) if a == arch]
        best = max(members, key=score)
        n, acc = updates.get(best, 0), accuracy.get(best)
        tied = [c for c in members if updates.get(c, 0) == n]
        rule = ("the only client of its architecture" if len(members) == 1 else "the most local updates"
                if len(tied) == 1 else "the most local updates, and of those the best accuracy on its own test split")
        acc_text = f"{100 * acc:.1f} %" if acc is not None and acc == acc else "n/a"
        of = f"the only client of architecture {arch}" if len(members) == 1 else \
            f"of the {len(members)} clients of architecture {arch}: {rule}"
        chosen[best] = f"client {best}, {of} ({n} local updates; final head accuracy on its own test split {acc_text})"
    return dict(sorted(chosen.items()))


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


def model_params(metrics: dict[str, float], split: str | None = None) -> dict[str, str]:
    """A logged model's own params: the figures measured when it was logged (``head_acc`` ...) and
    the split they were measured on (``eval_split``)."""
    out = {k: f"{v:.6g}" for k, v in metrics.items()}
    if split and metrics:
        out["eval_split"] = split
    return out


def log_pytorch_model(tracker, model, name: str, input_example: np.ndarray, metrics: dict[str, float], step: int,
                      split: str | None = None, tags: dict[str, Any] | None = None, why: str | None = None) -> str | None:
    """Log a :func:`loadable_copy` of ``model`` in the pickle format as an output of the run at ``step``,
    with ``metrics`` (measured on ``split``) as its params (:func:`model_params`); ``why`` (the model was
    chosen) is its description; returns the model id."""
    import rayfed_proto

    tags = {k: str(v) for k, v in (tags or {}).items()}
    if why:
        tags.update({"mlflow.note.content": f"{name}: {why}", "rayfed_proto.chosen_because": why[:5000]})
    return tracker.log_model(loadable_copy(model), name, step=step, tags=tags, model_params=model_params(metrics, split),
                             input_example=input_example, pip_requirements=pip_requirements(),
                             code_paths=[str(Path(rayfed_proto.__file__).resolve().parent)], **format_kwargs())
