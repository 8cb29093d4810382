"""Every packaged preset is a valid config (validated exactly as `rayfed-proto validate NAME`)."""

import pytest

from rayfed_proto.cli import preset_names, resolve_config_arg
from rayfed_proto.config import load_config


@pytest.mark.parametrize("name", preset_names())
def test_preset_validates(name):
    cfg = load_config(resolve_config_arg(name))
    assert cfg.federation.rounds >= cfg.federation.eval_every


def test_paper_presets_carry_the_papers_settings():
    silo = load_config(resolve_config_arg("fedsa_cross_silo"))
    device = load_config(resolve_config_arg("fedsa_cross_device"))
    assert (silo.federation.num_clients, silo.federation.participation) == (20, 1.0)
    assert (device.federation.num_clients, device.federation.participation) == (100, 0.1)
    for cfg in (silo, device):
        assert (cfg.data.name, cfg.model.group, cfg.data.partition.beta) == ("cifar100", "HtFE8", 0.1)
    for name in ("fedsa_cross_silo", "fedsa_cross_device", "fedsa_digits"):  # the authors' scripts: -lam 10 -mcl 1 -cc 1
        o = load_config(resolve_config_arg(name)).algorithm_options()
        assert (o.lam, o.lambda2, o.lambda3, o.alignment_reduction) == (10.0, 1.0, 1.0, "mean"), name
    printed = load_config(resolve_config_arg("fedsa_digits_printed")).algorithm_options()
    assert (printed.lam, printed.lambda2, printed.lambda3) == (0.1, 1.0, 1.0)
    sap = load_config(resolve_config_arg("fedsap_cifar10"))
    opts = sap.algorithm_options()
    assert (opts.proxy_scale, opts.lam) == (32, 0.7)
    assert (opts.alignment_schedule.start, opts.alignment_schedule.start + opts.alignment_schedule.length) == (20, 100)
    assert sap.data.partition.name == "nway_kshot" and sap.federation.num_clients == 20


def test_semi_supervised_preset_gives_every_client_a_separate_unlabelled_pool():
    # FedSAP Table 3's regime: k labelled shots per class plus a separate pool U_q of the client's classes
    from rayfed_proto.data import load_dataset, make_partition

    cfg = load_config(resolve_config_arg("fedsap_semi_digits"))
    assert cfg.algorithm_options().semi_supervised is not None
    p = make_partition(load_dataset(cfg.data, cfg.seed), cfg.data.partition, cfg.federation.num_clients, cfg.seed,
                       cfg.data.test_fraction)
    assert [len(c.unlabelled_idx) for c in p.clients] == [45] * cfg.federation.num_clients
    for c in p.clients:
        assert set(p.labels[c.unlabelled_idx]) == set(p.labels[c.train_idx])
