"""Shares planned per node (issue 27, item 1) and autoscaler requests withdrawn and narrowed
(item 2), with Ray stubbed: the real clusters run in tests/integration/test_multinode.py.

Each plan is checked against the nodes by an independent first-fit placement
(``autoscale.fits_on_nodes``), and, for the shipped cluster shapes, by trying the server on
every node as Ray's PACK strategy may place it.
"""

import sys
import types
from pathlib import Path

import pytest

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime import autoscale
from rayfed_proto.runtime.fleet import ActorFleet
from rayfed_proto.runtime.resources import plan_resources
from rayfed_proto.tuning.requests import NarrowRequest

ROOT = Path(__file__).resolve().parents[2]
HEAD = {"CPU": 0.0}


def bundles(plan) -> list[dict[str, float]]:
    """The run's placement-group bundles (as fleet.py makes them): server first, then one per client actor."""
    def one(cpus, gpus):
        return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}

    return [one(plan.server_num_cpus, plan.server_num_gpus)] + [one(plan.client_num_cpus, plan.client_num_gpus)] * plan.num_actors


def _put(bundle: dict[str, float], node: list) -> bool:
    """Place ``bundle`` on ``node`` ([free CPUs, [free share of each GPU]]) if it fits there."""
    cpu, gpu = bundle.get("CPU", 0.0), bundle.get("GPU", 0.0)
    if node[0] + 1e-9 < cpu:
        return False
    if gpu:
        slot = next((i for i, f in enumerate(node[1]) if f + 1e-9 >= gpu), None)
        if slot is None:
            return False
        node[1][slot] -= gpu
    node[0] -= cpu
    return True


def pack_fits(bs: list[dict[str, float]], nodes: list[dict[str, float]]) -> bool:
    """Ray's PACK, whichever node the server lands on: the server on node i, then the client
    bundles (all alike) first fit over the nodes."""
    for i in range(len(nodes)):
        state = [[n.get("CPU", 0.0), [1.0] * int(n.get("GPU", 0.0))] for n in nodes]
        if not _put(bs[0], state[i]):
            continue
        if not all(any(_put(b, node) for node in state) for b in bs[1:]):
            return False
    return True


def standing_request() -> list[dict[str, float]] | None:
    """The bundles this process has asked the autoscaler for and not withdrawn (autoscale's own
    record, which narrow_request and withdraw_request act on)."""
    return autoscale._standing


def cluster_yaml_nodes() -> list[dict[str, float]]:
    types_, cluster_max = autoscale.launcher_node_types(ROOT / "cluster.yaml")
    return [HEAD] + autoscale.launchable_nodes(types_, cluster_max, alive=[HEAD])


def test_default_experiment_fits_cluster_yaml_workers_with_no_resource_setting():
    nodes = cluster_yaml_nodes()
    assert nodes[1:] == [{"CPU": 8.0, "GPU": 1.0}] * 4
    cfg = build_config({}, [])  # the default experiment: 20 clients
    plan = plan_resources(cfg, 32, 4, nodes=nodes)
    assert (plan.num_actors, plan.server_num_cpus, plan.client_num_cpus) == (20, 1.0, 1.4)  # 4 + 5 + 5 + 5... 5 per node
    assert 0 < plan.client_num_gpus == plan.server_num_gpus <= 1 / 6  # 6 actors share the server's node's GPU
    assert autoscale.fits_on_nodes(bundles(plan), nodes) and pack_fits(bundles(plan), nodes)
    # what the totals gave (1 + 20 x 1.55 CPU): 19 of the bundles fit on 8-CPU nodes, never all 20
    by_totals = plan_resources(cfg, 32, 4)
    assert by_totals.client_num_cpus == 1.55 and not autoscale.fits_on_nodes(bundles(by_totals), nodes)


def test_every_share_of_a_plan_fits_whichever_node_holds_the_server():
    # mixed nodes: the client share must fit with the server on the small node and on the big one
    nodes = [HEAD, {"CPU": 4.0}, {"CPU": 2.0}, {"CPU": 3.0}]
    for n in (2, 5, 7, 9):
        plan = plan_resources(build_config({}, [f"federation.num_clients={n}", "federation.buffer_size=1"]), 9, 0, nodes=nodes)
        assert pack_fits(bundles(plan), nodes), (n, plan)
        # and it is the largest share that does (to Ray's 1e-4 grain)
        bigger = plan.client_num_cpus + 0.0001
        assert not pack_fits([bundles(plan)[0]] + [{"CPU": bigger}] * plan.num_actors, nodes), (n, plan)


def test_a_plan_that_cannot_fit_names_the_key_and_the_per_node_arithmetic():
    nodes = cluster_yaml_nodes()
    with pytest.raises(ConfigError) as e:
        plan_resources(build_config({}, ["resources.client_num_cpus=1.55"]), 32, 4, nodes=nodes)
    (issue,) = e.value.issues
    assert issue.key == "resources.client_num_cpus" and issue.value == 1.55
    assert "1 node of 8 CPU, 1 GPU: server (1 CPU, 0.2 GPU) + 4 x (1.55 CPU, 0.2 GPU) = 7.2 CPU, 1 GPU" in issue.allowed
    assert "3 nodes of 8 CPU, 1 GPU: 5 x (1.55 CPU, 0.2 GPU) = 7.75 CPU, 1 GPU each" in issue.allowed
    assert "19 of 20 client actors fit" in issue.allowed and "at most 1.4 fits" in issue.allowed


def test_gpu_and_server_shares_that_fit_no_node_name_their_keys():
    nodes = cluster_yaml_nodes()
    with pytest.raises(ConfigError) as e:
        plan_resources(build_config({}, ["resources.client_num_gpus=0.3"]), 32, 4, nodes=nodes)
    (issue,) = e.value.issues
    assert issue.key == "resources.client_num_gpus" and "at most 3 per GPU" in issue.allowed
    assert "of 20 client actors fit" in issue.allowed
    with pytest.raises(ConfigError) as e:
        plan_resources(build_config({}, ["resources.server_num_cpus=9"]), 32, 4, nodes=nodes)
    (issue,) = e.value.issues
    assert issue.key == "resources.server_num_cpus" and "fits on no node" in issue.allowed and "4 x 8 CPU, 1 GPU" in issue.allowed
    with pytest.raises(ConfigError, match="resources.cluster_cpus"):  # no worker yet and no node types: nothing to plan on
        plan_resources(build_config({}, []), 0, 0, nodes=[HEAD])


def test_one_node_plans_as_before():
    for cpus, gpus, n in ((2, 0, 20), (8, 0, 20), (4, 1, 20), (8, 2, 4)):
        cfg = build_config({}, [f"federation.num_clients={n}"])
        assert plan_resources(cfg, cpus, gpus) == plan_resources(cfg, cpus, gpus, nodes=[{"CPU": cpus, "GPU": gpus}])


# ----------------------------------------------------------------------------- capacity and requests


class FakeRay:
    def __init__(self, nodes):
        self.node_list = [{"Alive": True, "Resources": dict(n)} for n in nodes]
        self.requests = []

    def cluster_resources(self):
        out: dict[str, float] = {}
        for n in self.node_list:
            for k, v in n["Resources"].items():
                out[k] = out.get(k, 0.0) + v
        return out

    def nodes(self):
        return self.node_list


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay([HEAD])
    monkeypatch.setitem(sys.modules, "ray", fake)
    sdk = types.ModuleType("ray.autoscaler.sdk")
    sdk.request_resources = lambda bundles=None, num_cpus=None: fake.requests.append(bundles)
    monkeypatch.setitem(sys.modules, "ray.autoscaler", types.ModuleType("ray.autoscaler"))
    monkeypatch.setitem(sys.modules, "ray.autoscaler.sdk", sdk)
    monkeypatch.setattr(autoscale, "_standing", None)
    return fake


def test_capacity_counts_the_nodes_up_and_those_the_autoscaler_can_add(fake_ray, monkeypatch):
    monkeypatch.setenv(autoscale.NODE_TYPES_ENV, str(ROOT / "cluster.yaml"))  # as a RayJob names its node types
    fake_ray.node_list.append({"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0, "memory": 1e9}})
    cap = autoscale.capacity(build_config({}, []).resources)
    workers = [n for n in cap.planning_nodes if n.get("CPU")]
    assert len(workers) == 4 and all((n["CPU"], n["GPU"]) == (8.0, 1.0) for n in workers)  # 1 up + 3 more (max 4)
    assert (cap.cpus, cap.gpus) == (32.0, 4.0) and "cluster.yaml" in cap.source
    # a resources.cluster_cpus hint plans as one node of that size
    hinted = autoscale.capacity(build_config({}, ["resources.cluster_cpus=16"]).resources)
    assert hinted.planning_nodes == [{"CPU": 16.0, "GPU": 1.0}]


def test_a_runs_request_is_withdrawn_when_it_shuts_down_before_placement(fake_ray):
    plan = plan_resources(build_config({}, []), 32, 4, nodes=cluster_yaml_nodes())
    fleet = ActorFleet({}, plan, None, "t")
    fleet.requested = autoscale.request_if_short(bundles(plan))  # the head alone: short
    assert fleet.requested and len(fake_ray.requests[-1]) == 21
    fleet.shutdown()  # a failure before the first update: no actor, no group, but the request stood
    assert fake_ray.requests[-1] == [] and standing_request() is None and not fleet.requested


def test_a_sweeps_request_narrows_as_trials_finish(fake_ray):
    trial = [{"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.5}]
    assert autoscale.narrow_request(trial) is False and fake_ray.requests == []  # nothing of ours stands: nothing asked
    autoscale.request_if_short(trial * 2)
    callback = NarrowRequest(trial, concurrent=2, num_trials=4)
    trials = [types.SimpleNamespace(trial_id=str(i), status="RUNNING") for i in range(4)]
    asked = len(fake_ray.requests)
    for i, want in ((0, 2), (1, 2), (2, 1), (3, 0)):  # trials left: 3, 2, 1, 0
        trials[i].status = "TERMINATED" if i % 2 == 0 else "ERROR"
        (callback.on_trial_complete if i % 2 == 0 else callback.on_trial_error)(0, trials, trials[i])
        assert len(standing_request() or []) == 3 * want
    assert fake_ray.requests[asked:] == [trial, []]  # narrowed once to one trial's group, then withdrawn
