"""Client system profiles (rayfed_proto.system): MAC counts, simulated durations, speed and
availability profiles, and the `system:` config section's validation."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfed_proto.config import ConfigError, ExperimentConfig, build_config
from rayfed_proto.system import (
    SystemModel,
    architecture_macs,
    count_macs,
    load_availability_csv,
    load_speed_csv,
    lognormal_speeds,
)


def issues_of(raw):
    with pytest.raises(ConfigError) as exc:
        build_config(raw)
    return {i.key: i for i in exc.value.issues}, str(exc.value)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --------------------------------------------------------------------------- MACs and cost


def test_linear_macs_by_hand():
    assert count_macs(nn.Linear(4, 3), (1, 4)) == 12  # 4 inputs x 3 outputs


def test_conv_macs_by_hand_including_groups_and_ignoring_elementwise_layers():
    # Conv2d(2 -> 5, 3x3, no padding) on 6x6: output 5 x 4 x 4 = 80 values, each 2 x 3 x 3 = 18 MACs
    assert count_macs(nn.Conv2d(2, 5, 3), (1, 2, 6, 6)) == 80 * 18
    # depthwise: groups=4, padding 1 on 5x5: output 4 x 5 x 5 = 100 values, each 1 x 3 x 3 = 9 MACs
    assert count_macs(nn.Conv2d(4, 4, 3, padding=1, groups=4), (1, 4, 5, 5)) == 900
    net = nn.Sequential(nn.Conv2d(2, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(5 * 2 * 2, 3))
    assert count_macs(net, (1, 2, 6, 6)) == 80 * 18 + 20 * 3
    assert net.training  # mode restored


def test_zoo_mlp_macs_by_hand_and_rng_untouched():
    # mlp on 1 x 8 x 8: Linear(64, 256), Linear(256, 128), projection Linear(128, 16), head Linear(16, 10)
    by_hand = 64 * 256 + 256 * 128 + 128 * 16 + 16 * 10
    torch.manual_seed(3)
    expected_next = torch.rand(1)
    torch.manual_seed(3)
    assert architecture_macs("mlp", 1, 8, 10, 16) == by_hand
    assert architecture_macs("mlp", 1, 8, 10, 16, "mlp") == by_hand + 16 * 16  # Linear-ReLU-Linear projector
    assert torch.equal(torch.rand(1), expected_next)  # counting MACs consumed no global random numbers


def test_compute_s_by_hand_for_a_constant_speed():
    cfg = build_config({"seed": 1, "federation": {"num_clients": 4}, "training": {"local_epochs": 3},
                        "data": {"image_size": 8},
                        "model": {"group": "small_hetero", "feature_dim": 16},  # cnn, cnn_narrow, cnn_deep, mlp
                        "system": {"speed": {"kind": "constant", "value": 2.0}, "reference_flops": 1e6,
                                   "cost_per_sample": {"cnn": 0.5, "cnn_deep": 0.25, "cnn_narrow": 0.125}}})
    sizes = [10, 20, 30, 40]
    m = SystemModel.from_config(cfg, sizes, in_channels=1, image_size=8, num_classes=10)
    # 2 FLOPs/MAC x 3 passes / reference; model.projector pool (the default) pools 128 -> 16 without MACs
    mlp_cost = 6 * (64 * 256 + 256 * 128 + 16 * 10) / 1e6
    assert m.arch_cost_s == pytest.approx({"cnn": 0.5, "cnn_narrow": 0.125, "cnn_deep": 0.25, "mlp": mlp_cost})
    expected = [10 * 3 * 0.5 / 2, 20 * 3 * 0.125 / 2, 30 * 3 * 0.25 / 2, 40 * 3 * mlp_cost / 2]
    assert m.compute_s == pytest.approx(expected)
    assert list(m.speeds) == [2.0] * 4
    assert m.update_duration(1, 1000, 500) == pytest.approx(expected[1])  # no bandwidth set: transfers are free
    d = m.describe()
    assert d["speed_median"] == 2.0 and d["compute_s_max"] == pytest.approx(max(expected))
    assert d["upload_bytes_per_s"] == math.inf


def test_transfer_times_by_hand():
    m = SystemModel([1.0, 0.5], ["cnn", "cnn"], {"cnn": 0.1}, [10, 10], 1,
                    upload_bytes_per_s=1000.0, download_bytes_per_s=4000.0)
    assert m.transfer_s(8000, 500) == pytest.approx(8000 / 4000 + 500 / 1000)
    assert m.update_duration(1, 8000, 500) == pytest.approx(10 * 0.1 / 0.5 + 2.5)
    only_up = SystemModel([1.0], ["cnn"], {"cnn": 0.1}, [10], 1, upload_bytes_per_s=100.0)
    assert only_up.transfer_s(10**9, 50) == pytest.approx(0.5)  # download bandwidth unset: instantaneous
    with pytest.raises(ValueError):
        m.transfer_s(-1, 0)


# --------------------------------------------------------------------------- speeds


def test_lognormal_speeds_reproducible_per_seed_and_median_one():
    a, b, c = lognormal_speeds(7, 50, 1.0), lognormal_speeds(7, 50, 1.0), lognormal_speeds(8, 50, 1.0)
    assert np.array_equal(a, b) and not np.allclose(a, c)
    assert np.all(a > 0)
    assert lognormal_speeds(7, 10, 1.0) == pytest.approx(a[:10])  # client c's speed does not depend on N
    many = lognormal_speeds(0, 20000, 1.0)
    assert abs(np.median(many) - 1.0) < 0.05
    assert np.std(np.log(many)) == pytest.approx(1.0, abs=0.03)
    assert np.all(lognormal_speeds(0, 5, 0.0) == 1.0)


def test_lognormal_speeds_through_the_config():
    raw = {"federation": {"num_clients": 6}, "model": {"group": "HtFE1"},
           "system": {"speed": {"kind": "lognormal", "sigma": 0.5}, "cost_per_sample": {"cnn": 0.01}}}
    m1 = SystemModel.from_config(build_config({**raw, "seed": 5}), [10] * 6, 1, 32, 10)
    m2 = SystemModel.from_config(build_config({**raw, "seed": 5}), [10] * 6, 1, 32, 10)
    m3 = SystemModel.from_config(build_config({**raw, "seed": 6}), [10] * 6, 1, 32, 10)
    assert np.array_equal(m1.speeds, m2.speeds) and not np.allclose(m1.speeds, m3.speeds)
    assert np.array_equal(m1.speeds, lognormal_speeds(5, 6, 0.5))
    assert m1.compute_s == pytest.approx(10 * 0.01 / m1.speeds)


def test_speed_csv_is_read(tmp_path):
    path = write(tmp_path, "speeds.csv", "client_id,speed\n2,0.5\n0,1.0\n\n1, 3\n")
    assert list(load_speed_csv(path, 3)) == [1.0, 3.0, 0.5]
    cfg = build_config({"federation": {"num_clients": 3, "concurrency": 2, "buffer_size": 2},
                        "system": {"speed": {"kind": "csv", "path": path}}})
    assert list(SystemModel.from_config(cfg, [1, 1, 1], 1, 32, 10).speeds) == [1.0, 3.0, 0.5]


@pytest.mark.parametrize("rows, line, words", [
    ("0,1\n57,2\n", 3, "client_id 57 is not a client of this run (0..2)"),
    ("0,1\n-1,2\n", 3, "client_id -1 is not a client of this run"),
    ("0,1\n1.5,2\n", 3, "client_id '1.5' is not an integer"),
    ("0,1\n1,-2\n", 3, "speed -2 of client 1 must be > 0"),
    ("0,0\n", 2, "speed 0 of client 0 must be > 0"),
    ("0,fast\n", 2, "speed 'fast' is not a number"),
    ("0,nan\n", 2, "speed 'nan' is not a finite number"),
    ("0,1\n1,1\n0,2\n2,1\n", 4, "client_id 0 appears twice (first on line 2)"),
    ("0,1,2\n", 2, "expected 2 fields"),
])
def test_bad_speed_csv_is_refused_naming_key_file_and_line(tmp_path, rows, line, words):
    path = write(tmp_path, "speeds.csv", "client_id,speed\n" + rows)
    with pytest.raises(ConfigError) as exc:
        load_speed_csv(path, 3)
    text = str(exc.value)
    assert "system.speed.path" in text and path in text and f"line {line}: {words}" in text
    # the same file through the config: `rayfed-proto validate` refuses it before Ray starts
    issues, text = issues_of({"federation": {"num_clients": 3, "concurrency": 2, "buffer_size": 2},
                              "system": {"speed": {"kind": "csv", "path": path}}})
    assert issues["system.speed.path"].value == path and f"line {line}: {words}" in text


def test_speed_csv_missing_clients_listed(tmp_path):
    path = write(tmp_path, "speeds.csv", "client_id,speed\n0,1\n5,1\n")
    with pytest.raises(ConfigError) as exc:
        load_speed_csv(path, 20)
    (issue,) = exc.value.issues
    assert issue.key == "system.speed.path" and issue.value == path
    assert "missing: 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, ... (18 in all)" in issue.allowed


def test_speed_csv_bad_header_missing_file_and_many_bad_rows(tmp_path):
    with pytest.raises(ConfigError, match="line 1: the header must be client_id,speed, got id,speed"):
        load_speed_csv(write(tmp_path, "h.csv", "id,speed\n0,1\n"), 1)
    with pytest.raises(ConfigError, match="an existing CSV file"):
        load_speed_csv(str(tmp_path / "nope.csv"), 1)
    path = write(tmp_path, "many.csv", "client_id,speed\n" + "".join(f"{c},-1\n" for c in range(15)))
    with pytest.raises(ConfigError) as exc:
        load_speed_csv(path, 15)
    assert len(exc.value.issues) == 11 and "and 5 more bad rows" in exc.value.issues[-1].allowed


# --------------------------------------------------------------------------- availability


def test_availability_csv_windows_half_open_and_next_online_time(tmp_path):
    path = write(tmp_path, "av.csv", "client_id,start_s,end_s\n0,10,20\n0,50,60\n1,15,30\n0,18,25\n")
    windows = load_availability_csv(path, 3)
    assert windows == {0: [(10.0, 25.0), (50.0, 60.0)], 1: [(15.0, 30.0)]}  # overlapping windows merged
    m = SystemModel([1.0] * 3, ["cnn"] * 3, {"cnn": 1.0}, [1] * 3, 1, availability="csv", windows=windows)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert m.online_clients([0, 1], 9.999, rng) == []
    assert m.online_clients([0, 1], 10.0, rng) == [0]  # start is inside
    assert m.online_clients([1, 0], 15.0, rng) == [1, 0]  # candidates' order kept
    assert m.online_clients([0, 1], 25.0, rng) == [1]  # end is outside
    assert m.online_clients([0, 1], 30.0, rng) == []
    assert m.online_clients([0, 1, 2], 1e9, rng) == [2]  # client 2 has no window: always online
    assert rng.bit_generator.state == state  # csv draws nothing
    assert m.next_online_time([0, 1], 0.0) == 10.0
    assert m.next_online_time([1], 0.0) == 15.0
    assert m.next_online_time([0, 1], 12.0) == 12.0  # someone is online now
    assert m.next_online_time([0, 1], 30.0) == 50.0
    assert m.next_online_time([0, 1], 60.0) is None  # never again
    assert m.next_online_time([2], 60.0) == 60.0
    assert m.next_online_time([], 0.0) is None


@pytest.mark.parametrize("rows, line, words", [
    ("0,0,10\n9,0,10\n", 3, "client_id 9 is not a client of this run (0..2)"),
    ("0,10,10\n", 2, "end_s 10 must be greater than start_s 10"),
    ("0,10,5\n", 2, "end_s 5 must be greater than start_s 10"),
    ("0,-1,5\n", 2, "start_s -1 must be >= 0"),
    ("0,a,5\n", 2, "start_s 'a' is not a number"),
    ("0,1,inf\n", 2, "end_s 'inf' is not a finite number"),
])
def test_bad_availability_csv_refused_naming_key_file_and_line(tmp_path, rows, line, words):
    path = write(tmp_path, "av.csv", "client_id,start_s,end_s\n" + rows)
    issues, text = issues_of({"federation": {"num_clients": 3, "concurrency": 2, "buffer_size": 2},
                              "system": {"availability": {"kind": "csv", "path": path}}})
    assert issues["system.availability.path"].value == path and f"line {line}: {words}" in text


def test_probability_online_matches_the_draws_in_order():
    m = SystemModel([1.0] * 8, ["cnn"] * 8, {"cnn": 1.0}, [1] * 8, 1, availability="probability", p=0.6,
                    retry_s=30.0)
    cands = [7, 2, 5, 0, 3, 6]
    rng, twin = np.random.default_rng(11), np.random.default_rng(11)
    for _ in range(20):
        online = m.online_clients(cands, 0.0, rng)
        draws = twin.random(len(cands))  # the same single draw, by hand
        assert online == [c for c, u in zip(cands, draws, strict=True) if u < 0.6]
        assert all(u < 0.6 for c, u in zip(cands, draws, strict=True) if c in online)  # never one the draw marked offline
    assert rng.bit_generator.state == twin.bit_generator.state  # exactly one rng.random(len) per call
    assert m.next_online_time(cands, 100.0) == 130.0
    always = SystemModel([1.0], ["cnn"], {"cnn": 1.0}, [1], 1)
    state = rng.bit_generator.state
    assert always.online_clients([0], 5.0, rng) == [0] and always.next_online_time([0], 5.0) == 5.0
    assert rng.bit_generator.state == state
    assert SystemModel([1.0] * 3, ["cnn"] * 3, {"cnn": 1.0}, [1] * 3, 1, availability="probability",
                       p=1.0).online_clients([2, 0, 1], 0.0, rng) == [2, 0, 1]


def test_availability_from_config():
    cfg = build_config({"system": {"availability": {"kind": "probability", "p": 0.25, "retry_s": 5}},
                        "model": {"group": "HtFE1"}})
    n = cfg.federation.num_clients
    m = SystemModel.from_config(cfg, [1] * n, 1, 32, 10)
    assert (m.availability, m.p, m.retry_s) == ("probability", 0.25, 5.0)
    assert m.describe()["availability_p"] == 0.25


# --------------------------------------------------------------------------- config section


def test_system_null_is_the_default_wall_clock_mode():
    assert ExperimentConfig().system is None
    cfg = build_config({})
    assert cfg.system is None and cfg.flat()["system"] is None
    with pytest.raises(ValueError, match="wall-clock"):
        SystemModel.from_config(cfg, [1] * cfg.federation.num_clients, 1, 32, 10)


def test_empty_system_mapping_turns_the_model_on_with_defaults():
    s = build_config({"system": {}}).system
    assert s is not None and (s.speed.kind, s.speed.value, s.availability.kind) == ("constant", 1.0, "always")
    assert s.reference_flops == 1e9 and s.upload_bytes_per_s is None and s.cost_per_sample == {}
    assert build_config({}, ["system.speed.kind=lognormal"]).system.speed.sigma == 1.0  # --set creates the section


@pytest.mark.parametrize("raw, key, words", [
    ({"speed": {"kind": "lognormal", "sigma": -1}}, "system.speed.sigma", "greater than or equal to 0"),
    ({"speed": {"kind": "gamma"}}, "system.speed.kind", "one of constant, lognormal, csv"),
    ({"speed": {"sigma": 1}}, "system.speed.kind", "required, one of constant, lognormal, csv"),
    ({"speed": {"kind": "constant", "sigma": 1}}, "system.speed.sigma", "unknown key"),
    ({"speed": {"kind": "constant", "value": 0}}, "system.speed.value", "greater than 0"),
    ({"speed": {"kind": "csv"}}, "system.speed.path", "required"),
    ({"availability": {"kind": "probability", "p": 0}}, "system.availability.p", "(0, 1]"),
    ({"availability": {"kind": "probability", "p": 1.5}}, "system.availability.p", "(0, 1]"),
    ({"availability": {"kind": "probability", "retry_s": 0}}, "system.availability.retry_s", "greater than 0"),
    ({"availability": {"kind": "sometimes"}}, "system.availability.kind", "one of always, probability, csv"),
    ({"upload_bytes_per_s": -5}, "system.upload_bytes_per_s", "greater than 0"),
    ({"download_bytes_per_s": 0}, "system.download_bytes_per_s", "greater than 0"),
    ({"reference_flops": 0}, "system.reference_flops", "greater than 0"),
    ({"cost_per_sample": {"cnn": -1.0}}, "system.cost_per_sample.cnn", "greater than 0"),
    ({"cost_per_sample": {"vgg99": 1.0}}, "system.cost_per_sample.vgg99", "architecture names: cnn"),
    ({"concurrency": 4}, "system.concurrency", "unknown key"),
])
def test_bad_system_values_are_refused_naming_the_key(raw, key, words):
    issues, text = issues_of({"system": raw})
    assert key in issues and words in issues[key].allowed, text


def test_max_update_starts_bounds_the_updates_the_windows_hold():
    from types import SimpleNamespace

    from rayfed_proto.runtime.policies import min_update_starts

    # compute_s = 10 samples x 1 epoch x 0.1 s / speed: 1.0 s (client 0), 2.0 s (client 1)
    windows = {0: [(0.0, 2.5), (10.0, 11.0)], 1: [(0.0, 4.0), (5.0, 5.0)]}
    m = SystemModel([1.0, 0.5], ["cnn", "cnn"], {"cnn": 0.1}, [10, 10], 1, availability="csv", windows=windows)
    # client 0: ceil(2.5 / 1) + ceil(1 / 1) = 4; client 1: ceil(4 / 2) = 2 and the empty window 0
    assert m.max_update_starts() == 6.0
    partly = SystemModel([1.0, 0.5], ["cnn", "cnn"], {"cnn": 0.1}, [10, 10], 1, availability="csv", windows={0: windows[0]})
    assert partly.max_update_starts() == math.inf  # client 1 has no window: always online
    assert SystemModel([1.0], ["cnn"], {"cnn": 0.1}, [10], 1).max_update_starts() == math.inf
    fed = SimpleNamespace(mode="async", buffer_size=5, rounds=10)
    assert min_update_starts(fed) == 50 and min_update_starts(fed, start_version=8) == 10
    assert min_update_starts(SimpleNamespace(mode="sync", buffer_size=5, rounds=10)) == 10
