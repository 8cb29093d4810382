"""Logged models load as the modules they were, only the metrics that measure a model are linked to
it, a first run prints no warning the user can do nothing about (issue 26 items 4-5, issue 30 items 5-6).

A run of the federation is too slow for a unit test: the models are logged the way
``RunLogging.finish`` logs them (``tracking.models.log_pytorch_model`` through ``MlflowTracker``), into
a sqlite store of the test's own, next to metrics logged as a run logs them."""

import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mlflow = pytest.importorskip("mlflow")

from rayfed_proto.tracking.report import summary_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEP = 2  # the final version: the models are logged at it, as run metrics are


def _shown(caught) -> list[str]:
    """The warnings Python prints by default: not the deprecation notices of MLflow's own dependencies."""
    return [f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught
            if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A run with eval/, federation/ and system/ metrics at every step up to STEP, its datasets, a
    channels_last client model and a server model logged at STEP, then one more run metric at STEP."""
    import pandas as pd
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from rayfed_proto.config import TrackingConfig
    from rayfed_proto.models import build_model
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker
    from rayfed_proto.tracking.models import log_pytorch_model

    tmp = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tracker = MlflowTracker(TrackingConfig(tracking_uri=uri, experiment_name="models", system_metrics=False))
    client = MlflowClient(uri)
    client.create_experiment("models", artifact_location=str(tmp / "artifacts"))  # not ./mlruns of the test's cwd
    tracker.start({"algorithm.name": "fedproto"})
    frame = pd.DataFrame({"sample_index": np.arange(6), "client_id": np.zeros(6, np.int32), "label": np.arange(6) % 3})
    dataset = mlflow.data.from_pandas(frame, targets="label", name="digits/test")
    with warnings.catch_warnings(record=True) as dataset_warnings:
        warnings.simplefilter("always")
        tracker.log_inputs([dataset], ["testing"], [{"rayfed_proto.split": "digits/test"}])
    for s in range(STEP + 1):
        tracker.log_metrics({"eval/head_acc": 0.1 * s, "federation/wall_s": 10.0 * s}, step=s)
        client.log_batch(tracker.run_id, metrics=[Metric("system/cpu_utilization_percentage", 50.0, 0, s)])  # the monitor's way

    torch.manual_seed(0)
    client_model = build_model("cnn", 1, 8, 10, feature_dim=16).eval().to(memory_format=torch.channels_last)
    server_model = build_model("mlp", 1, 8, 10, feature_dim=16).eval()
    x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    records = _Records()
    mlflow_logger = logging.getLogger("mlflow")
    mlflow_logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as model_warnings:
            warnings.simplefilter("always")
            ids = {"client_0": log_pytorch_model(tracker, client_model, "client_0", x, {"head_acc": 0.5, "test_samples": 2.0},
                                                 STEP, split="digits/test", tags={"client_id": 0}),
                   "server": log_pytorch_model(tracker, server_model, "server", x, {"global_acc": 0.25}, STEP)}
    finally:
        mlflow_logger.removeHandler(records)
    tracker.log_metrics({"eval/head_acc_mean": 0.3}, step=STEP)  # a run metric after the models, at their step
    tracker.end()
    return {"uri": uri, "client": client, "run_id": tracker.run_id, "ids": ids, "x": x, "tmp": tmp,
            "models": {"client_0": client_model, "server": server_model},
            "model_warnings": list(model_warnings), "mlflow_log": records.records,
            "dataset_warnings": list(dataset_warnings)}


def test_a_logged_model_loads_as_an_nn_module_with_eval_and_the_same_forward(logged):
    from rayfed_proto.models import ProtoModel

    mlflow.set_tracking_uri(logged["uri"])
    x = torch.from_numpy(logged["x"])
    for name, model_id in logged["ids"].items():
        loaded = mlflow.pytorch.load_model(f"models:/{model_id}")
        assert isinstance(loaded, ProtoModel) and isinstance(loaded, torch.nn.Module), type(loaded)
        assert loaded.eval() is loaded and not loaded.training  # a torch.fx GraphModule (pt2) raises here
        assert all(p.is_contiguous() for p in loaded.parameters())  # NCHW, whatever layout the run trained in
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), logged["models"][name](x))
        assert loaded.features(x).shape == (2, 16)  # the module itself: more than a traced forward
    # pickle format, with the package as a code path: the module's classes import where it is not installed
    files = Path(mlflow.artifacts.download_artifacts(f"models:/{logged['ids']['client_0']}", tracking_uri=logged["uri"],
                                                     dst_path=str(logged["tmp"] / "download")))
    assert (files / "data" / "model.pth").is_file() and not list(files.rglob("*.pt2"))
    assert (files / "code" / "rayfed_proto" / "models" / "zoo.py").is_file()


def test_the_logged_model_loads_in_a_fresh_process(logged):
    """Unpickling imports rayfed_proto.models itself (from the model's code path where the package
    is not installed); nothing of the logging process is needed."""
    code = ("import mlflow.pytorch, torch\n"
            f"m = mlflow.pytorch.load_model('models:/{logged['ids']['client_0']}')\n"
            "print(type(m).__module__, type(m).__name__, m.eval().training, m(torch.zeros(1, 1, 8, 8)).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=logged["tmp"],
                         env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                              "MLFLOW_TRACKING_URI": logged["uri"]})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-5:] == ["rayfed_proto.models.zoo", "ProtoModel", "False", "torch.Size([1,", "10])"]


def test_logging_a_channels_last_model_warns_nothing(logged):
    assert _shown(logged["model_warnings"]) == []  # pt2: torch's "No complete tensor found in the group"
    assert [r.getMessage()[:120] for r in logged["mlflow_log"]] == []  # nor MLflow's pickle notice
    conv = next(m for m in logged["models"]["client_0"].modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # the run's own model is left as it was


def test_models_are_outputs_at_the_final_step_with_their_figures_as_params_and_no_metric_linked(logged):
    """Issue 49: a model was an input of its run too (step "-" on the Overview), and its accuracy a
    one-point run chart ``model/<name>/<key>``."""
    client, run_id, ids = logged["client"], logged["run_id"], logged["ids"]
    own = {"client_0": {"head_acc": "0.5", "test_samples": "2", "eval_split": "digits/test"},
           "server": {"global_acc": "0.25"}}
    for name, model_id in ids.items():
        model = client.get_logged_model(model_id)
        assert not model.metrics, name
        assert {k: model.params[k] for k in own[name]} == own[name] and model.params["algorithm.name"] == "fedproto"
        assert model.source_run_id == run_id and model.name == name
    assert client.get_logged_model(ids["client_0"]).tags["client_id"] == "0"
    run = client.get_run(run_id)
    assert {(o.model_id, o.step) for o in run.outputs.model_outputs} == {(ids["client_0"], STEP), (ids["server"], STEP)}
    assert not (run.inputs.model_inputs or [])  # outputs only: the Overview's "Output", at step STEP
    assert not any(k.startswith("model/") for k in run.data.metrics)
    for key in ("eval/head_acc", "federation/wall_s", "system/cpu_utilization_percentage", "eval/head_acc_mean"):
        history = client.get_metric_history(run_id, key)
        assert history and all(m.model_id is None for m in history), key
    # the models as the experiment's Models tab finds them
    found = client.search_logged_models(experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    assert {m.name for m in found} == {"client_0", "server"}


def test_logging_the_datasets_prints_no_integer_schema_hint(logged):
    assert _shown(logged["dataset_warnings"]) == []  # "Hint: Inferred schema contains integer column(s)..."


def _history(server_train_s: float) -> list[dict]:
    return [{"version": 1, "federation/wall_s": 50.0, "server/train_s": server_train_s / 2, "federation/slot_utilisation": 0.1},
            {"version": 2, "federation/wall_s": 100.0, "server/train_s": server_train_s, "federation/slot_utilisation": 0.07}]


def test_the_summary_says_when_the_servers_training_explains_a_low_slot_utilisation():
    rows = dict(summary_rows(_history(81.0)))
    assert rows["slot utilisation"] == "7.0% (the server's training took 81% of the wall time)"
    assert dict(summary_rows(_history(20.0)))["slot utilisation"] == "7.0%"  # the server is not why: no note
    assert dict(summary_rows([{"version": 1, "federation/slot_utilisation": 0.5}]))["slot utilisation"] == "50.0%"


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11) or tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_the_license_is_an_spdx_expression_and_setuptools_does_not_warn():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message)[:80] for w in caught if "license" in str(w.message).lower()] == []
    assert getattr(dist.metadata, "license_expression", "Apache-2.0") == "Apache-2.0"


def test_dependencies_are_listed_once_and_optuna_only_in_its_extra():
    from packaging.requirements import Requirement

    meta = _pyproject()
    core = [Requirement(r) for r in meta["project"]["dependencies"]]
    names = [r.name.lower() for r in core]
    assert len(names) == len(set(names)), names
    assert "optuna" not in names
    extras = meta["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "optuna" for r in extras["optuna"])
    ray = next(r for r in core if r.name == "ray")
    # ray.tune.report / RunConfig / Checkpoint (tuning/) first shipped in Ray 2.41.0
    assert not ray.specifier.contains("2.40.0") and ray.specifier.contains("2.41.0")
    assert any(r.startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in meta["build-system"]["requires"])  # license = "<SPDX>" (PEP 639)


def test_the_store_lock_beside_mlflow_db_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "mlflow.db.lock"], capture_output=True)
    assert ignored.returncode == 0  # 1: not ignored, `make demo` would leave it untracked in the checkout
