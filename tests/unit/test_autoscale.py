"""Planning against the cluster that will exist, and asking the autoscaler for it (Ray stubbed:
the real thing runs in tests/integration/test_multinode.py)."""

import sys
import types

import pytest
import yaml

from rayfed_proto.config import ConfigError, InputError, build_config
from rayfed_proto.runtime import autoscale
from rayfed_proto.runtime.resources import plan_resources

LAUNCHER = {
    "cluster_name": "x", "max_workers": 3, "head_node_type": "head",
    "available_node_types": {
        "head": {"resources": {"CPU": 0}, "max_workers": 0, "node_config": {}},
        "gpu_worker": {"resources": {"CPU": 8, "GPU": 1}, "min_workers": 0, "max_workers": 2, "node_config": {}},
        "cpu_worker": {"resources": {"CPU": 4}, "min_workers": 0, "max_workers": 4, "node_config": {}},
        "detected": {"resources": {}, "max_workers": 4, "node_config": {}},  # left to detection: unknown
    },
}


class FakeRay:
    """ray.cluster_resources / ray.nodes of an empty autoscaling cluster; request_resources recorded."""

    def __init__(self, totals=None, nodes=None):
        self.totals = totals or {"memory": 1e9}
        self.node_list = nodes if nodes is not None else [{"Alive": True, "Resources": {"memory": 1e9}}]
        self.requests = []

    def cluster_resources(self):
        return dict(self.totals)

    def nodes(self):
        return self.node_list


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    sdk = types.ModuleType("ray.autoscaler.sdk")
    sdk.request_resources = lambda bundles=None, num_cpus=None: fake.requests.append(bundles)
    monkeypatch.setitem(sys.modules, "ray.autoscaler", types.ModuleType("ray.autoscaler"))
    monkeypatch.setitem(sys.modules, "ray.autoscaler.sdk", sdk)
    return fake


def test_launcher_node_types_count_known_types_up_to_the_cluster_max(tmp_path):
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(LAUNCHER))
    types_, cluster_max = autoscale.launcher_node_types(path)
    assert sorted(r["CPU"] for r, _ in types_) == [4, 8] and cluster_max == 3
    # largest (GPU) type first: 2 x (8 CPU, 1 GPU) + 1 x 4 CPU = 3 nodes, the cluster's max_workers
    grown = autoscale.launchable_nodes(types_, cluster_max, alive=[])
    assert {k: sum(n[k] for n in grown) for k in ("CPU", "GPU")} == {"CPU": 20.0, "GPU": 2.0}
    assert autoscale.launcher_node_types(tmp_path / "absent.yaml") is None


def test_empty_autoscaling_cluster_plans_from_the_launcher_node_types(fake_ray, tmp_path):
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(LAUNCHER))
    cfg = build_config({}, ["federation.num_clients=10"])
    with pytest.raises(ConfigError, match="resources.cluster_cpus"):  # what the cluster reports: 0 CPUs
        plan_resources(cfg, 0.0, 0.0)
    cap = autoscale.capacity(cfg.resources, bootstrap=path)
    assert (cap.cpus, cap.gpus) == (20.0, 2.0) and "worker node types" in cap.source
    assert {"CPU": 8.0, "GPU": 1.0} in cap.nodes  # a bundle is checked against the shapes that will exist
    plan = plan_resources(cfg, cap.cpus, cap.gpus)
    assert plan.num_actors == 10 and plan.client_num_gpus > 0  # gpus 'auto' is not 0 on a GPU cluster to be


def test_explicit_cluster_cpus_wins_and_is_validated(fake_ray, tmp_path):
    cfg = build_config({}, ["resources.cluster_cpus=6", "resources.cluster_gpus=0"])
    cap = autoscale.capacity(cfg.resources, bootstrap=tmp_path / "absent.yaml")
    assert (cap.cpus, cap.gpus) == (6.0, 0.0) and cap.source.startswith("resources.cluster_cpus")
    with pytest.raises(ConfigError, match="resources.cluster_cpus"):
        build_config({}, ["resources.cluster_cpus=0"])
    # a cluster larger than the hint now: its own totals count
    fake_ray.totals = {"CPU": 16.0}
    assert autoscale.capacity(cfg.resources, bootstrap=tmp_path / "absent.yaml").cpus == 16.0


def test_request_only_when_short_and_only_cpu_gpu(fake_ray):
    bundles = [{"CPU": 1.0, "node:10.0.0.1": 0.001}, {"CPU": 0.5, "GPU": 0.25}, {"node:10.0.0.1": 0.001}]
    assert autoscale.request_if_short(bundles) is True
    assert fake_ray.requests == [[{"CPU": 1.0}, {"CPU": 0.5, "GPU": 0.25}]]
    fake_ray.totals = {"CPU": 2.0, "GPU": 1.0}
    fake_ray.node_list = [{"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0, "node:10.0.0.1": 1.0}}]
    assert autoscale.request_if_short(bundles) is False and len(fake_ray.requests) == 1
    # 2 CPUs in all, but on two 1-CPU nodes: a 2-CPU bundle fits on neither
    fake_ray.node_list = [{"Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0}}, {"Alive": True, "Resources": {"CPU": 1.0}}]
    assert autoscale.request_if_short([{"CPU": 2.0}]) is True  # short per node, not in total
    autoscale.withdraw_request()
    assert fake_ray.requests[-1] == []


def test_wait_placed_names_what_was_asked_and_what_the_cluster_has(fake_ray):
    fake_ray.wait = lambda refs, timeout: ([], refs)
    fake_ray.totals = {"CPU": 1.0}

    class PG:
        def ready(self):
            return object()

    with pytest.raises(InputError) as e:
        autoscale.wait_placed(PG(), [{"CPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}], 0.01, progress=False,
                              advice="Lower resources.client_num_cpus.", requested=True)
    msg = str(e.value)
    assert "placement_timeout_s" in msg and "3 CPU, 1 GPU in all" in msg and "the cluster has 1 CPU, 0 GPU on 1 nodes (CPUs per node: 0;" in msg
    assert "request_resources" in msg and "Lower resources.client_num_cpus." in msg
    assert fake_ray.requests[-1] == []  # the request is withdrawn either way


def test_a_replacement_on_a_dying_node_is_started_again(monkeypatch):
    import ray
    from ray.exceptions import ActorDiedError, RayTaskError

    outcomes = [ActorDiedError(), ActorDiedError(), "ok"]

    def get(ref, timeout=None):
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(ray, "get", get)
    started = []
    actor = autoscale.replace_until_started(lambda: (started.append(1) or f"actor{len(started)}", "ref"), 60, pause_s=0)
    assert actor == "actor3" and len(started) == 3
    outcomes[:] = [ActorDiedError()]
    with pytest.raises(ActorDiedError):  # out of time: the death is raised
        autoscale.replace_until_started(lambda: ("a", "ref"), 0.001, pause_s=1)
    outcomes[:] = [RayTaskError("setup", "tb", ValueError("bad"))]
    with pytest.raises(RayTaskError):  # an error in setup is not retried
        autoscale.replace_until_started(lambda: ("a", "ref"), 60, pause_s=0)
