"""On a GPU the two worker layouts must agree (issue 36 item 2): one actor per client with a
fractional GPU share each, and the packed default, over 5 rounds of FedProto with HtFE8 on
gpu_share.py's workload (CIFAR-shaped synthetic data, Dirichlet 0.1, batch 10, sync).

Skipped without CUDA. Run alone (``bench/gpu_check.sh`` does): it starts its own Ray instance
with the machine's real GPUs, since the shared test instance declares 2 logical GPUs, and an
actor placed on a GPU index the machine lacks computes on the CPU. No MLflow (a bare GPU
machine has none): ``tracking.enabled=false``.
"""

from __future__ import annotations

import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.tracking import metric_names as names

pytestmark = [pytest.mark.integration, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORKLOAD = ["data.name=synthetic", "data.num_samples=10000", "data.image_size=32", "data.channels=3",
            "data.partition.name=dirichlet", "data.partition.beta=0.1", "data.partition.min_samples=20",
            "model.group=HtFE8", "algorithm.name=fedproto", "training.batch_size=10",
            "federation.num_clients=20", "federation.mode=sync", "federation.participation=1.0",
            "federation.rounds=5", "federation.eval_every=1", "checkpoint.every=0", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    gpus = torch.cuda.device_count()
    started = not ray.is_initialized()
    if started:
        ray.init(num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    elif ray.cluster_resources().get("GPU", 0) > gpus:
        pytest.skip("a Ray instance declaring more GPUs than the machine has is running; run this file alone")
    yield ray
    if started:
        ray.shutdown()


def _run(layout: str, deterministic: bool, tmp_path):
    from rayfed_proto.runtime.driver import run_experiment

    cfg = build_config({}, WORKLOAD + [f"resources.clients_per_actor={layout}", f"tracking.output_dir={tmp_path}",
                                       f"resources.deterministic={str(deterministic).lower()}"])
    return run_experiment(cfg, progress=False, echo=lambda s: None)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_one_actor_per_client_and_packed_agree_on_a_gpu(gpu_ray, tmp_path, deterministic):
    runs = {layout: _run(layout, deterministic, tmp_path / layout) for layout in ("1", "auto")}
    assert runs["1"].resource_plan["num_actors"] == 20 and 0 < runs["1"].resource_plan["client_num_gpus"] < 1
    finals = {}
    for layout, res in runs.items():
        assert {str(p.get("device")) for p in res.placements} == {"cuda"}, layout  # every actor on the GPU
        last = res.history[-1]
        assert last[names.FEDERATION_UPDATES_REFUSED] == 0, (layout, last)  # no NaN upload refused
        assert [h[names.RELIABILITY_CLIENTS_NONFINITE] for h in res.history if names.EVAL_HEAD_ACC in h] == [0] * 6, layout
        finals[layout] = 100.0 * last[names.EVAL_HEAD_ACC]
    if deterministic:  # the same kernels in every process: the layouts give the same figures
        assert finals["1"] == pytest.approx(finals["auto"], abs=1e-6), finals
    else:
        assert abs(finals["1"] - finals["auto"]) <= 0.5, finals
