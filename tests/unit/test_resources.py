"""Per-actor resource shares: everything fits the cluster, impossible requests name the key."""

import pytest

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime import autoscale
from rayfed_proto.runtime.resources import assign_clients, plan_resources


def plan(overrides, cpus=2.0, gpus=0.0):
    return plan_resources(build_config({}, overrides), cpus, gpus)


def test_auto_packing_makes_one_worker_per_cpu():
    p = plan(["federation.num_clients=20"])  # resources.clients_per_actor: auto (the default)
    assert p.num_actors == 2 and p.clients_per_actor == 10
    assert p.server_num_cpus == 0.5 and p.client_num_cpus == 0.75 and p.torch_threads == 1 and p.concurrency == 2
    p = plan(["federation.num_clients=20"], cpus=8)
    assert p.num_actors == 8 and p.clients_per_actor == 3  # 20 clients over 8 slots: 3, 3, ..., 2
    p = plan(["federation.num_clients=3"], cpus=8)
    assert p.num_actors == 3 and p.clients_per_actor == 1  # never more workers than clients
    p = plan(["federation.num_clients=20"], cpus=4, gpus=1)
    assert p.num_actors == 4 and p.client_num_gpus == pytest.approx(0.2)  # 4 workers + server share the GPU


def test_auto_packing_never_creates_more_actors_than_slots():
    for cpus in (1, 2, 3, 7, 16):
        for n in (1, 5, 20, 1000):
            p = plan([f"federation.num_clients={n}", "federation.buffer_size=1"], cpus=cpus)
            assert p.num_actors <= min(cpus, n)
            assert p.num_actors * p.clients_per_actor >= n


def test_one_client_per_actor_keeps_fractional_shares():
    p = plan(["federation.num_clients=20", "resources.clients_per_actor=1"])
    assert p.num_actors == 20 and p.server_num_cpus == 0.5
    assert p.server_num_cpus + 20 * p.client_num_cpus <= 2.0
    assert p.client_num_gpus == 0 and p.concurrency == 2 and p.torch_threads == 1


def test_auto_gpu_share_splits_between_server_and_actors():
    p = plan(["federation.num_clients=4"], cpus=8, gpus=1)
    assert p.client_num_gpus == pytest.approx(0.2) and p.server_num_gpus == pytest.approx(0.2)
    assert p.server_num_gpus + 4 * p.client_num_gpus <= 1.0


def test_clients_per_actor_reduces_actors():
    p = plan(["federation.num_clients=10", "resources.clients_per_actor=4"])
    assert p.num_actors == 3
    assert assign_clients(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_assignment_balances_work_across_actors():
    # longest first onto the least loaded actor with room: 9 -> a0, 8 -> a1, 5 -> a1 (8 < 9), 4 -> a0, 1 -> a1, 1 -> a0
    work = [1.0, 9.0, 4.0, 8.0, 5.0, 1.0]
    groups = assign_clients(6, 3, work=work)
    assert groups == [[0, 1, 2], [3, 4, 5]]
    assert [sum(work[c] for c in g) for g in groups] == [14.0, 14.0]
    assert sorted(c for g in groups for c in g) == list(range(6))
    # capacity is respected even when one client dominates
    groups = assign_clients(5, 2, work=[100.0, 1.0, 1.0, 1.0, 1.0])
    assert max(len(g) for g in groups) <= 2 and sorted(c for g in groups for c in g) == list(range(5))


def test_more_gpus_than_the_cluster_has_is_refused_with_the_key():
    with pytest.raises(ConfigError) as exc:
        plan(["federation.num_clients=4", "resources.client_num_gpus=0.5"], gpus=1)
    issue = exc.value.issues[0]
    assert issue.key == "resources.client_num_gpus" and issue.value == 0.5
    assert "do not fit the nodes' GPUs" in issue.allowed and "at most 2 per GPU" in issue.allowed


def test_more_cpus_than_the_cluster_has_is_refused():
    with pytest.raises(ConfigError, match="resources.client_num_cpus"):
        plan(["federation.num_clients=4", "resources.client_num_cpus=1"], cpus=2)


def test_explicit_concurrency_is_capped_by_actor_count_and_threads_follow_cpus():
    p = plan(["federation.num_clients=6", "resources.clients_per_actor=3", "federation.concurrency=4",
              "federation.buffer_size=2"], cpus=8)
    assert p.concurrency == 2  # two actors can run two updates at once
    p = plan(["federation.num_clients=2", "resources.client_num_cpus=2", "federation.buffer_size=1"], cpus=8)
    assert p.torch_threads == 2


def gpu_requests_fit(requests: list[float], gpus: float) -> bool:
    """Whether these GPU requests can be placed at once on one node of ``gpus`` GPUs, by the
    autoscaler's own fit (whole requests take whole GPUs, a fractional one must fit on one GPU)."""
    return autoscale.fits_on_nodes([{"GPU": r} for r in requests], [{"GPU": float(gpus)}])


def test_fractional_gpu_shares_must_fit_on_single_gpus():
    # 5 x 0.4 = 2.0 GPUs in total, but only two 0.4 shares fit on one GPU: the fifth has no room
    assert not gpu_requests_fit([0.4] * 5, 2)
    assert gpu_requests_fit([0.33] * 6, 2) and not gpu_requests_fit([0.33] * 7, 2)
    assert gpu_requests_fit([1, 1, 0.5, 0.5], 3) and not gpu_requests_fit([2, 0.5], 2)
    assert gpu_requests_fit([0, 0], 0)


def test_auto_gpu_share_packs_per_gpu():
    p = plan(["federation.num_clients=4"], cpus=8, gpus=2)  # 5 actors on 2 GPUs: 3 per GPU
    assert p.client_num_gpus == pytest.approx(0.33)
    assert gpu_requests_fit([p.server_num_gpus] + [p.client_num_gpus] * 4, 2)
    with pytest.raises(ConfigError, match="fit on one GPU"):
        plan(["federation.num_clients=4", "resources.client_num_gpus=0.4", "resources.server_num_gpus=0.4"], cpus=8, gpus=2)
