"""Plug-ins through entry points: groups rayfed_proto.models, rayfed_proto.datasets, rayfed_proto.algorithms.

The example package tests/plugin_example is not installed: each test writes a ``*.dist-info``
folder (METADATA + entry_points.txt, what pip writes) into tmp_path, with the entry points read
from the example's pyproject.toml, and runs a fresh Python with tmp_path and the package's
sources on sys.path, where ``importlib.metadata`` finds them as it finds an installed package.
A fresh process is also what a Ray actor is: it sees plug-ins only through the entry points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from rayfed_proto.registry import PLUGIN_GROUPS, load_plugins

EXAMPLE = Path(__file__).resolve().parents[1] / "plugin_example"
REPO = Path(__file__).resolve().parents[2]


def example_entry_points() -> dict[str, dict[str, str]]:
    """``{group: {name: module}}`` from tests/plugin_example/pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11) or tomli")
    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]


def write_dist_info(site: Path, name: str, entry_points: dict[str, dict[str, str]]) -> None:
    """A distribution as pip installs it, reduced to what importlib.metadata reads."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{ep} = {module}\n" for ep, module in eps.items()) + "\n"
        for group, eps in entry_points.items()))


def run_python(code: str, *paths: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONWARNINGS"] = "default"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_example_package_declares_both_groups():
    eps = example_entry_points()
    assert set(eps) == {"rayfed_proto.models", "rayfed_proto.datasets", "rayfed_proto.policies"} <= set(PLUGIN_GROUPS)
    for modules in eps.values():
        for module in modules.values():
            assert (EXAMPLE / (module.replace(".", "/") + ".py")).is_file()


def test_plugin_dataset_and_model_group_run_in_a_fresh_process(tmp_path):
    write_dist_info(tmp_path, "rfp-plugin-example", example_entry_points())
    proc = run_python("""
        import contextlib, io, json, warnings
        with warnings.catch_warnings(record=True) as caught:  # a plug-in that fails to load warns
            warnings.simplefilter("always")
            import numpy as np
            from rayfed_proto.config import build_config
            from rayfed_proto.data import DATASETS, load_dataset, make_partition
            from rayfed_proto.models import ARCHITECTURES, MODEL_GROUPS, build_client_model
            from rayfed_proto.cli import main

        cfg = build_config({"data": {"name": "plugin_stripes", "image_size": 8, "partition": {"name": "natural"}},
                            "model": {"group": "plugin_tiny", "feature_dim": 16},
                            "federation": {"num_clients": 4, "mode": "plugin_round_robin", "participation": 0.5}})
        from rayfed_proto.runtime.policies import make_policy

        policy = type(make_policy(cfg.federation, None, seed=0, real_slots=1)).__name__
        ds = load_dataset(cfg.data, cfg.seed)
        part = make_partition(ds, cfg.data.partition, cfg.federation.num_clients, cfg.seed)
        archs, outputs = [], []
        for client in range(2):
            model = build_client_model(cfg.model.group, client, ds.channels, ds.image_size, ds.num_classes,
                                       cfg.model.feature_dim)
            x, _ = ds.tensors(np.arange(5))
            archs.append(model.arch)
            outputs.append(list(model(x).shape))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["list"])
        print(json.dumps({
            "datasets": DATASETS.names(), "groups": MODEL_GROUPS.names(), "archs": ARCHITECTURES.names(),
            "group": MODEL_GROUPS.get("plugin_tiny"), "shape": list(ds.images.shape),
            "class_names": ds.class_names, "clients": len(part.clients), "client_archs": archs,
            "outputs": outputs, "listed": out.getvalue(), "policy": policy,
            "warnings": [str(w.message) for w in caught if "plug-in" in str(w.message)],
        }))
    """, tmp_path, EXAMPLE)
    got = last_json(proc)
    assert got["warnings"] == []
    assert "plugin_stripes" in got["datasets"] and "digits" in got["datasets"]
    assert "plugin_tiny" in got["groups"] and "small_hetero" in got["groups"]
    assert "plugin_tiny_mlp" in got["archs"] and "cnn" in got["archs"]
    assert got["group"] == ["plugin_tiny_mlp", "mlp"]
    assert got["shape"] == [64, 1, 8, 8] and got["class_names"] == ["horizontal", "vertical"]
    assert got["clients"] == 4  # the plug-in's client_ids, through the natural partitioner
    assert got["client_archs"] == ["plugin_tiny_mlp", "mlp"] and got["outputs"] == [[5, 2], [5, 2]]
    assert got["policy"] == "RoundRobin"  # federation.mode from the plug-in's policy, in a process that imported only the package
    for name in ("plugin_stripes", "plugin_tiny", "plugin_tiny_mlp"):
        assert name in got["listed"]  # rayfed-proto list


def test_a_model_plugin_loads_with_rayfed_proto_models_alone(tmp_path):
    """What an actor that builds client models does: import rayfed_proto.models, nothing else first."""
    write_dist_info(tmp_path, "rfp-plugin-example", example_entry_points())
    proc = run_python("""
        import json
        from rayfed_proto.models import build_client_model
        print(json.dumps({"arch": build_client_model("plugin_tiny", 2, 1, 8, 2, 16).arch}))
    """, tmp_path, EXAMPLE)
    assert last_json(proc) == {"arch": "plugin_tiny_mlp"}


def test_without_the_entry_points_the_names_are_config_errors():
    proc = run_python("""
        import json
        from rayfed_proto.config import ConfigError, build_config
        try:
            build_config({"data": {"name": "plugin_stripes"}, "model": {"group": "plugin_tiny"}})
        except ConfigError as e:
            print(json.dumps({"keys": sorted(i.key for i in e.issues)}))
    """, EXAMPLE)  # the sources are importable, but nothing declares them
    assert last_json(proc) == {"keys": ["data.name", "model.group"]}


BROKEN = {
    "rayfed_proto.algorithms": {"missing": "rfp_broken_missing_module"},
    "rayfed_proto.datasets": {"taken": "rfp_broken.taken_name"},
    "rayfed_proto.models": {"raises": "rfp_broken.raises"},
}


def test_a_broken_plugin_warns_and_the_builtins_and_other_plugins_stay(tmp_path):
    write_dist_info(tmp_path, "rfp-plugin-example", example_entry_points())
    write_dist_info(tmp_path, "rfp-broken", BROKEN)
    pkg = tmp_path / "rfp_broken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "taken_name.py").write_text(
        "from rayfed_proto.data import DATASETS\nDATASETS.add('digits', lambda cfg, seed: None, 'not the digits')\n")
    (pkg / "raises.py").write_text("raise RuntimeError('plug-in import failed on purpose')\n")
    proc = run_python("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import rayfed_proto
            from rayfed_proto.algorithms import ALGORITHMS
            from rayfed_proto.data import DATASETS
            from rayfed_proto.data.datasets import load_digits
            from rayfed_proto.models import ARCHITECTURES, MODEL_GROUPS
        print(json.dumps({
            "warnings": [str(w.message) for w in caught if "plug-in" in str(w.message)],
            "digits_builtin": DATASETS.get("digits") is load_digits,
            "have": ["fedproto" in ALGORITHMS, "cnn" in ARCHITECTURES, "small_hetero" in MODEL_GROUPS,
                     "plugin_stripes" in DATASETS, "plugin_tiny" in MODEL_GROUPS],
        }))
    """, tmp_path, EXAMPLE)
    got = last_json(proc)
    assert got["digits_builtin"] and all(got["have"])
    messages = got["warnings"]
    assert len(messages) == 3, messages
    expected = [("algorithm plug-in 'missing' (rfp_broken_missing_module, entry point group rayfed_proto.algorithms)",
                 "ModuleNotFoundError"),
                ("dataset plug-in 'taken' (rfp_broken.taken_name, entry point group rayfed_proto.datasets)",
                 "dataset 'digits' is already registered"),
                ("model plug-in 'raises' (rfp_broken.raises, entry point group rayfed_proto.models)",
                 "plug-in import failed on purpose")]
    for head, cause in expected:
        assert any(head in m and "failed to load and is skipped" in m and cause in m for m in messages), (head, messages)


def test_load_plugins_refuses_an_unknown_group():
    with pytest.raises(ValueError, match="plug-in group 'rayfed_proto.dataset': one of rayfed_proto.algorithms, "
                                         "rayfed_proto.datasets, rayfed_proto.models, rayfed_proto.policies"):
        load_plugins("rayfed_proto.dataset", "dataset")
    from importlib.metadata import entry_points

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed ones (none in the test environment) load again quietly
        assert load_plugins("rayfed_proto.models", "model") == sorted(ep.name for ep in entry_points(
            group="rayfed_proto.models"))
