"""Config loading, overrides and the errors a user sees (key, value, what is allowed)."""

import pytest

from rayfed_proto.config import ConfigError, build_config, load_config, parse_override


def issues_of(raw, overrides=None):
    with pytest.raises(ConfigError) as exc:
        build_config(raw, overrides)
    return {i.key: i for i in exc.value.issues}, str(exc.value)


def test_defaults_are_the_demo_and_valid():
    cfg = build_config({})
    assert (cfg.algorithm.name, cfg.data.name, cfg.federation.mode) == ("fedtgp", "digits", "async")
    assert cfg.algorithm_options().lam == 10.0


def test_overrides_are_typed_yaml_scalars():
    cfg = build_config({}, ["federation.mode=sync", "federation.rounds=7", "algorithm.name=fedproto",
                            "algorithm.lam=0.5", "data.download=true", "resources.client_num_gpus=0.25"])
    assert cfg.federation.mode == "sync" and cfg.federation.rounds == 7
    assert cfg.algorithm_options().lam == 0.5 and cfg.data.download is True
    assert cfg.resources.client_num_gpus == 0.25
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])


def test_unknown_algorithm_names_key_value_and_allowed():
    issues, text = issues_of({"algorithm": {"name": "fedfoo"}})
    assert issues["algorithm.name"].value == "fedfoo"
    assert "fedavg" in issues["algorithm.name"].allowed and "fedtgp" in issues["algorithm.name"].allowed
    assert "algorithm.name = 'fedfoo'" in text


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_participation_outside_unit_interval(value):
    issues, _ = issues_of({"federation": {"participation": value}})
    assert "(0, 1]" in issues["federation.participation"].allowed
    assert issues["federation.participation"].value == value


def test_buffer_larger_than_concurrency():
    issues, _ = issues_of({"federation": {"concurrency": 2, "buffer_size": 3}})
    assert "at most federation.concurrency (2)" in issues["federation.buffer_size"].allowed


def test_heterogeneous_group_with_fedavg():
    issues, _ = issues_of({"algorithm": {"name": "fedavg"}, "model": {"group": "small_hetero"}})
    assert "HtFE1" in issues["model.group"].allowed and "same architecture" in issues["model.group"].allowed
    assert build_config({"algorithm": {"name": "fedavg"}, "model": {"group": "HtFE1"}}).algorithm.name == "fedavg"


def test_unknown_keys_and_bad_literals_and_algorithm_options():
    issues, _ = issues_of({"federation": {"mdoe": "sync", "mode": "fast"}, "algorithm": {"name": "fedtgp", "lamda": 3}})
    assert issues["federation.mdoe"].allowed == "unknown key"
    assert issues["federation.mode"].allowed == "one of async, sync" and issues["federation.mode"].value == "fast"
    assert issues["algorithm.lamda"].allowed.startswith("not an option of fedtgp")
    assert "margin_threshold" in issues["algorithm.lamda"].allowed  # lists what fedtgp accepts


def test_option_of_another_algorithm_says_which_one_owns_it():
    issues, _ = issues_of({"algorithm": {"name": "fedproto", "server_epochs": 5}})
    allowed = issues["algorithm.server_epochs"].allowed
    owners = allowed[allowed.index("(it belongs to ") + len("(it belongs to "):allowed.index(")")].split(", ")
    assert "fedtgp" in owners and "fedproto" not in owners  # every method with that option, never the chosen one


def test_unknown_dataset_partitioner_and_group_listed():
    issues, _ = issues_of({"data": {"name": "imagenet", "partition": {"name": "zipf"}}, "model": {"group": "HtFE9"}})
    assert "digits" in issues["data.name"].allowed and "dirichlet" in issues["data.partition.name"].allowed
    assert "HtFE8" in issues["model.group"].allowed


def test_auto_or_number_fields():
    issues, _ = issues_of({"resources": {"client_num_gpus": "lots"}})
    assert "resources.client_num_gpus" in issues
    issues, _ = issues_of({"resources": {"client_num_gpus": 1.5}})
    assert "fraction" in issues["resources.client_num_gpus"].allowed


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="an existing YAML file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("federation: [unclosed")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("federation: {mode: sync, rounds: 3, eval_every: 1}\n")
    assert load_config(good, ["seed=4"]).seed == 4


def test_flat_params_cover_the_whole_config():
    flat = build_config({}, ["algorithm.name=fedproto"]).flat()
    assert flat["federation.mode"] == "async" and flat["data.partition.beta"] == 0.1
    assert flat["algorithm.name"] == "fedproto"
    # the algorithm's defaults are resolved into the config, so MLflow records them too
    assert flat["algorithm.lam"] == 10.0 and flat["algorithm.aggregation"] == "uniform"  # FedSA / FedTGP scripts
    assert build_config({}, ["algorithm.lam=1e-1"]).flat()["algorithm.lam"] == 0.1  # typed, not the string


def test_every_problem_is_reported_in_one_pass():
    issues, _ = issues_of({"federation": {"participation": 1.5}, "algorithm": {"name": "fedfoo"}})
    assert set(issues) == {"federation.participation", "algorithm.name"}


def test_algorithm_cross_field_rule_semi_supervised_phase_must_start():
    issues, _ = issues_of({"algorithm": {"name": "fedsap", "semi_supervised": {"supervised_versions": 100}},
                           "federation": {"rounds": 50, "eval_every": 5}})
    issue = issues["algorithm.semi_supervised.supervised_versions"]
    assert issue.value == 100 and "fewer than federation.rounds (50)" in issue.allowed
    ok = build_config({"algorithm": {"name": "fedsap", "semi_supervised": {"supervised_versions": 20}},
                       "federation": {"rounds": 50, "eval_every": 5}})
    assert ok.algorithm_options().semi_supervised.supervised_versions == 20


def test_algorithm_config_defaults_apply_only_where_the_user_left_the_key_unset():
    # FedAvg wants a global test set (data.global_test_fraction 0.2) unless the user says otherwise
    assert build_config({}, ["algorithm.name=fedavg", "model.group=HtFE1"]).data.global_test_fraction == 0.2
    assert build_config({}, ["algorithm.name=fedavg", "model.group=HtFE1",
                             "data.global_test_fraction=0.05"]).data.global_test_fraction == 0.05
    assert build_config({}).data.global_test_fraction == 0.0  # fedtgp: no global model, no holdout
    assert build_config({}).data.public_size == 0


def test_corrupt_client_ids_must_exist():
    issues, _ = issues_of({"federation": {"num_clients": 3}, "faults": {"corrupt_clients": [0, 5]}})
    assert issues["faults.corrupt_clients"].allowed == "client ids in 0..2"


def test_a_method_that_needs_a_public_set_refuses_public_size_zero():
    issues, _ = issues_of({"algorithm": {"name": "fedprotokd"}, "data": {"public_size": 0}})
    assert issues["data.public_size"].allowed.startswith("at least 1: fedprotokd distils through a public proxy set")
    assert build_config({"algorithm": {"name": "fedprotokd"}}).data.public_size == 2500  # its default


def test_fedtgp_aggregates_every_clients_latest_upload_by_default_in_async_mode_only():
    # async (the default mode): every client's latest upload, staleness-weighted (issue 15)
    assert build_config({}).algorithm_options().aggregation_scope == "latest"
    assert build_config({}, ["algorithm.name=fedtgp", "federation.mode=async"]).algorithm.model_extra[
        "aggregation_scope"] == "latest"
    # sync: FedTGP's round, the sampled clients' uploads
    assert build_config({}, ["federation.mode=sync"]).algorithm_options().aggregation_scope == "buffer"
    # a value the user sets wins; other methods keep their own default
    assert build_config({}, ["algorithm.aggregation_scope=buffer"]).algorithm_options().aggregation_scope == "buffer"
    assert build_config({}, ["algorithm.name=fedproto"]).algorithm_options().aggregation_scope == "buffer"


def test_a_group_is_homogeneous_when_the_clients_it_names_share_one_architecture():
    from rayfed_proto.config import group_is_homogeneous

    # client i gets archs[i % len(archs)]: HtFE8's first client alone is one architecture, two are two
    assert group_is_homogeneous("HtFE1", 10_000) and group_is_homogeneous("HtFE8", 1)
    assert not group_is_homogeneous("HtFE8", 2) and not group_is_homogeneous("HtFE8", 10_000)
