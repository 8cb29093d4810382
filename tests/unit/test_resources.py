"""Per-actor resource shares: everything fits the cluster, impossible requests name the key."""

import pytest

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime.resources import assign_clients, plan_resources


def plan(overrides, cpus=2.0, gpus=0.0):
    return plan_resources(build_config({}, overrides), cpus, gpus)


def test_auto_shares_fit_twenty_actors_on_two_cpus():
    p = plan(["federation.num_clients=20"])
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


def test_more_gpus_than_the_cluster_has_is_refused_with_the_key():
    with pytest.raises(ConfigError) as exc:
        plan(["federation.num_clients=4", "resources.client_num_gpus=0.5"], gpus=1)
    issue = exc.value.issues[0]
    assert issue.key == "resources.client_num_gpus" and issue.value == 0.5
    assert "do not fit the cluster's 1 GPUs" in issue.allowed


def test_more_cpus_than_the_cluster_has_is_refused():
    with pytest.raises(ConfigError, match="resources.client_num_cpus"):
        plan(["federation.num_clients=4", "resources.client_num_cpus=1"], cpus=2)


def test_explicit_concurrency_is_capped_by_actor_count_and_threads_follow_cpus():
    p = plan(["federation.num_clients=6", "resources.clients_per_actor=3", "federation.concurrency=4",
              "federation.buffer_size=2"], cpus=8)
    assert p.concurrency == 2  # two actors can run two updates at once
    p = plan(["federation.num_clients=2", "resources.client_num_cpus=2", "federation.buffer_size=1"], cpus=8)
    assert p.torch_threads == 2


def test_fractional_gpu_shares_must_fit_on_single_gpus():
    from rayfed_proto.runtime.resources import gpu_requests_fit

    # 5 x 0.4 = 2.0 GPUs in total, but only two 0.4 shares fit on one GPU: the fifth has no room
    assert not gpu_requests_fit([0.4] * 5, 2)
    assert gpu_requests_fit([0.33] * 6, 2) and not gpu_requests_fit([0.33] * 7, 2)
    assert gpu_requests_fit([1, 1, 0.5, 0.5], 3) and not gpu_requests_fit([2, 0.5], 2)
    assert gpu_requests_fit([0, 0], 0)


def test_auto_gpu_share_packs_per_gpu():
    from rayfed_proto.runtime.resources import gpu_requests_fit

    p = plan(["federation.num_clients=4"], cpus=8, gpus=2)  # 5 actors on 2 GPUs: 3 per GPU
    assert p.client_num_gpus == pytest.approx(0.33)
    assert gpu_requests_fit([p.server_num_gpus] + [p.client_num_gpus] * 4, 2)
    with pytest.raises(ConfigError, match="fit on one GPU"):
        plan(["federation.num_clients=4", "resources.client_num_gpus=0.4", "resources.server_num_gpus=0.4"], cpus=8, gpus=2)
