"""``rayfed-proto compare`` on runs these tests create with MlflowClient in a sqlite store (no Ray).

The store (built once, copied for the tests that write to it):

* experiment ``cmp_a``: FedAvg seeds 0, 1, 2 nested under a seeds-group parent run without
  metrics; an earlier FedAvg seed-0 run (superseded by the later one); a FAILED run and a KILLED run;
* experiment ``cmp_b``: FedProto seeds 0, 1, 2 as children of a sweep parent (which has
  ``sweep/trials`` and ``best/eval/head_acc``, not ``eval/head_acc``), with prototype accuracy
  and simulated time; seed 1 was resumed and redid versions 10 and 15 (two points each, tag
  ``superseded_steps``); a RUNNING run.

Expected means and stds are written out by hand below (population std over the seeds).
"""

from __future__ import annotations

import csv
import math
import shutil

import numpy as np
import pytest

from rayfed_proto.config import InputError
from rayfed_proto.tracking import compare as cmp

STEPS = (5, 10, 15)
FEDAVG = {0: (0.40, 0.60, 0.50), 1: (0.50, 0.70, 0.70), 2: (0.30, 0.80, 0.60)}
FEDPROTO = {0: (0.50, 0.80, 0.90), 1: (0.60, 0.85, 0.80), 2: (0.70, 0.75, 0.85)}
PROTO = {0: 0.88, 1: 0.82, 2: 0.85}  # FedProto's eval/proto_acc at version 15
SIM = {0: (10.0, 20.0, 30.0), 1: (12.0, 22.0, 32.0), 2: (11.0, 21.0, 31.0)}  # federation/sim_time_s


def _std(*v: float) -> float:
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def _params(algorithm: str, seed: int, **extra) -> dict[str, str]:
    p = {"algorithm.name": algorithm, "seed": str(seed), "data.name": "digits", "federation.rounds": "15",
         "federation.mode": "sync", "tracking.run_name": f"{algorithm}-s{seed}", "tracking.output_dir": f"runs/{algorithm}{seed}",
         "resources.num_cpus": str(2 + seed), "plan.num_actors": str(1 + seed), "checkpoint.every": "5",
         "client.test_samples": str([10 + seed, 12])}  # the partition's, differs with the seed: never a group key
    if algorithm == "fedproto":
        p["algorithm.lam"] = "1.0"
    p.update({k: str(v) for k, v in extra.items()})
    return p


class Store:
    def __init__(self, path):
        from mlflow.tracking import MlflowClient

        self.path = path
        self.uri = f"sqlite:///{path}"
        self.client = MlflowClient(self.uri)
        self.t = 1_700_000_000_000
        self.ids: dict[str, str] = {}

    def tick(self) -> int:
        self.t += 1000
        return self.t

    def run(self, label, exp_id, params=None, metrics=(), status="FINISHED", tags=None, name=None) -> str:
        from mlflow.entities import Metric, Param

        c = self.client
        run = c.create_run(exp_id, start_time=self.tick(), tags=dict(tags or {}), run_name=name or label)
        rid = run.info.run_id
        c.log_batch(rid, params=[Param(k, v) for k, v in (params or {}).items()],  # one write per run: a fast setup
                    metrics=[Metric(key, value, self.tick(), step) for key, value, step in metrics])
        if status != "RUNNING":
            c.set_terminated(rid, status)
        self.ids[label] = rid
        return rid


def _history(key, values):
    return [(key, v, s) for s, v in zip(STEPS, values, strict=True)]


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    st = Store(path)
    c = st.client
    a, b = c.create_experiment("cmp_a"), c.create_experiment("cmp_b")
    # --- cmp_a: an earlier FedAvg seed-0 run, then a seeds group (parent without metrics) of three
    st.run("fedavg_s0_old", a, _params("fedavg", 0), _history("eval/head_acc", (0.1, 0.1, 0.1)))
    parent = st.run("seeds_parent", a, {"algorithm.name": "fedavg"}, name="fedavg seeds 0 1 2")
    for s, values in FEDAVG.items():
        st.run(f"fedavg_s{s}", a, _params("fedavg", s), _history("eval/head_acc", values),
               tags={"mlflow.parentRunId": parent})
    st.run("failed", a, _params("fedavg", 3), _history("eval/head_acc", (0.9, 0.9, 0.9)), status="FAILED",
           tags={"failure_reason": "no new server version for 3600 s"})
    st.run("killed", a, _params("fedavg", 4), _history("eval/head_acc", (0.9, 0.9, 0.9))[:1], status="KILLED",
           tags={"stopped": "SIGINT", "resume_from": "runs/fedavg4"})
    # --- cmp_b: a sweep parent with metrics of its own (not eval/head_acc), FedProto trials as children
    sweep = st.run("sweep_parent", b, {"sweep.metric": "eval/head_acc"},
                   [("sweep/trials", 3.0, 0), ("best/eval/head_acc", 0.9, 0)], tags={"rayfed_proto.sweep": "lam"})
    for s, values in FEDPROTO.items():
        metrics = _history("eval/head_acc", values) + _history("federation/sim_time_s", SIM[s])
        metrics.append(("eval/proto_acc", PROTO[s], 15))
        tags = {"mlflow.parentRunId": sweep}
        if s == 1:  # logged up to 15, resumed from the checkpoint of version 5: versions 10 and 15 redone
            metrics = ([("eval/head_acc", values[0], 5), ("eval/head_acc", 0.95, 10), ("eval/head_acc", 0.30, 15)]
                       + [("eval/head_acc", values[1], 10), ("eval/head_acc", values[2], 15)]
                       + _history("federation/sim_time_s", SIM[s]) + [("eval/proto_acc", PROTO[s], 15)])
            tags["superseded_steps"] = "10-15"
        st.run(f"fedproto_s{s}", b, _params("fedproto", s), metrics, tags=tags)
    st.run("running", b, _params("fedproto", 3), _history("eval/head_acc", (0.99, 0.99, 0.99))[:2], status="RUNNING")
    return path, dict(st.ids)


@pytest.fixture
def store(store_file, tmp_path):
    """A private copy of the store (a test may log a comparison run into it)."""
    src, ids = store_file
    dst = tmp_path / "mlflow.db"
    shutil.copy(src, dst)
    return f"sqlite:///{dst}", ids


def test_groups_numbers_and_exclusions(store):
    uri, ids = store
    comp = cmp.compare(["cmp_a", "cmp_b"], tracking_uri=uri)

    # grouping: by method; seed, tracking.*, resources.*, plan.* differ per run but are no keys;
    # FedProto's algorithm.lam is no key (FedAvg has no such option, and FedProto's runs agree)
    assert comp.group_keys == []
    assert [g.label for g in comp.groups] == ["fedavg", "fedproto"]
    fedavg, fedproto = comp.groups
    assert [r.run_id for r in fedavg.runs] == [ids[f"fedavg_s{s}"] for s in (0, 1, 2)]  # nested seed runs count
    assert [r.run_id for r in fedproto.runs] == [ids[f"fedproto_s{s}"] for s in (0, 1, 2)]  # sweep children count
    assert fedavg.seeds == fedproto.seeds == ["0", "1", "2"]

    # final (version 15) and best over the seeds, by hand
    f, b = fedavg.final(), fedavg.best("max")
    assert (f.n, b.n) == (3, 3)
    assert f.mean == pytest.approx((0.5 + 0.7 + 0.6) / 3) and f.std == pytest.approx(_std(0.5, 0.7, 0.6))
    assert b.mean == pytest.approx((0.6 + 0.7 + 0.8) / 3) and b.std == pytest.approx(_std(0.6, 0.7, 0.8))
    # seed 1's superseded points (0.95 at 10, 0.30 at 15) are replaced by the later ones
    f, b = fedproto.final(), fedproto.best("max")
    assert f.mean == pytest.approx((0.9 + 0.8 + 0.85) / 3) and f.std == pytest.approx(_std(0.9, 0.8, 0.85))
    assert b.mean == pytest.approx((0.9 + 0.85 + 0.85) / 3) and b.std == pytest.approx(_std(0.9, 0.85, 0.85))
    p = fedproto.final("eval/proto_acc")
    assert p.mean == pytest.approx((0.88 + 0.82 + 0.85) / 3) and p.std == pytest.approx(_std(0.88, 0.82, 0.85))
    assert fedavg.final("eval/proto_acc").n == 0  # FedAvg logs no prototype accuracy
    assert comp.extras == ["eval/proto_acc"] and comp.has_sim_time
    assert any(ids["fedproto_s1"] in n and "2 superseded points" in n for n in comp.notes)

    # left out, each with its reason
    reasons = {lo.run_id: lo.reason for lo in comp.left_out}
    assert set(reasons) == {ids[k] for k in ("fedavg_s0_old", "seeds_parent", "failed", "killed", "sweep_parent",
                                             "running")}
    assert reasons[ids["failed"]] == "failed: no new server version for 3600 s"
    assert reasons[ids["running"]].startswith("unfinished (status RUNNING)")
    assert reasons[ids["killed"]].startswith("killed (stopped: SIGINT)") and "--resume runs/fedavg4" in reasons[ids["killed"]]
    assert reasons[ids["seeds_parent"]].startswith("parent run of 3 nested runs")
    assert reasons[ids["sweep_parent"]].startswith("parent run of 3 nested runs")
    assert reasons[ids["fedavg_s0_old"]] == f"superseded by the later run {ids['fedavg_s0']} of the same group and seed 0"


def test_tables_csv_and_markdown(store, tmp_path):
    uri, ids = store
    comp = cmp.compare(["cmp_a", "cmp_b"], tracking_uri=uri)
    paths = cmp.write_tables(comp, tmp_path / "out")

    rows = list(csv.DictReader(paths["csv"].open()))
    assert [r["group"] for r in rows] == ["fedavg", "fedproto"]
    avg, proto = rows
    assert avg["n_seeds"] == "3" and avg["seeds"] == "0 1 2" and avg["last_version"] == "15"
    assert float(avg["final eval/head_acc mean"]) == pytest.approx(0.6)
    assert float(avg["final eval/head_acc std"]) == pytest.approx(_std(0.5, 0.7, 0.6))
    assert float(proto["best eval/head_acc mean"]) == pytest.approx((0.9 + 0.85 + 0.85) / 3)
    assert avg["final eval/proto_acc mean"] == "" and proto["eval/proto_acc n"] == "3"
    assert proto["run_ids"].split() == [ids[f"fedproto_s{s}"] for s in (0, 1, 2)]

    md = paths["markdown"].read_text()
    assert "| group | n seeds | final eval/head_acc (%) | best eval/head_acc (%) | final eval/proto_acc (%) |" in md
    # 100 x (mean ± std), one decimal: fedavg final 60.0 ± 8.2, best 70.0 ± 8.2
    assert "| fedavg | 3 (0, 1, 2) | 60.0 ± 8.2 | 70.0 ± 8.2 | n/a | n/a | 15 |" in md
    assert "| fedproto | 3 (0, 1, 2) | 85.0 ± 4.1 | 86.7 ± 2.4 | 85.0 ± 2.4 | 85.0 ± 2.4 | 15 |" in md
    assert "Left out (6 runs):" in md and "failed: no new server version for 3600 s" in md

    left = {r["run_id"]: r for r in csv.DictReader(paths["left_out"].open())}
    assert left[ids["running"]]["status"] == "RUNNING" and left[ids["failed"]]["status"] == "FAILED"
    assert left[ids["killed"]]["experiment"] == "cmp_a" and len(left) == 6


def test_curves_against_version_and_simulated_time(store, tmp_path):
    uri, _ = store
    comp = cmp.compare(["cmp_a", "cmp_b"], tracking_uri=uri)
    fedavg, fedproto = comp.groups
    x, mean, std, n = cmp.group_curve(fedavg, "version")
    assert x.tolist() == [5, 10, 15] and n.tolist() == [3, 3, 3]
    assert mean == pytest.approx([0.4, 0.7, 0.6]) and std == pytest.approx([_std(0.4, 0.5, 0.3), _std(0.6, 0.7, 0.8),
                                                                            _std(0.5, 0.7, 0.6)])
    assert cmp.group_curve(fedavg, "sim_time") is None  # no virtual clock: not in the time plot
    # against simulated time: over the span every seed reaches (12 s .. 30 s), interpolated; at 20 s
    # seed 0 has 0.80 (its point), seed 1 0.6 + 0.8 x 0.25 = 0.80, seed 2 0.7 + 0.9 x 0.05 = 0.745
    x, mean, std, n = cmp.group_curve(fedproto, "sim_time")
    assert x.min() == 12.0 and x.max() == 30.0 and set(n.tolist()) == {3}
    i = x.tolist().index(20.0)
    assert mean[i] == pytest.approx((0.80 + 0.80 + 0.745) / 3) and std[i] == pytest.approx(_std(0.80, 0.80, 0.745))

    paths = cmp.write_outputs(comp, tmp_path / "out")
    for key in ("plot_version", "plot_sim_time"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_a = cmp.compare(["cmp_a"], tracking_uri=uri)
    assert "plot_sim_time" not in cmp.write_outputs(only_a, tmp_path / "a")  # no run has simulated time


def _series(values, steps=STEPS):
    return cmp.Series(np.array(steps), np.array(values, float))


def _rs(run_id, algorithm, seed, start=0, **params):
    p = _params(algorithm, seed, **params)
    return cmp.RunSeries(run_id, "x", run_id, start, p, _series((0.5, 0.6, 0.7)))


def test_grouping_keys_are_the_differing_config_keys():
    runs = [_rs("a0", "fedproto", 0, **{"algorithm.lam": 1}), _rs("a1", "fedproto", 1, **{"algorithm.lam": 1}),
            _rs("b0", "fedproto", 0, **{"algorithm.lam": 10}),
            _rs("c0", "fedtgp", 0, **{"algorithm.lam": 1, "data.partition.beta": 0.5}),
            _rs("d0", "fedavg", 0, **{"data.partition.beta": 0.1, "data.root": "/elsewhere", "federation.eval_every": 1})]
    # lam differs between FedProto runs; beta between any runs; data.root, eval_every, seed, tracking.*,
    # resources.*, plan.* never count
    assert cmp.grouping_keys(runs) == ["algorithm.lam", "data.partition.beta"]
    groups, keys, superseded = cmp.group_runs(runs)
    assert [g.label for g in groups] == ["fedavg data.partition.beta=0.1", "fedproto algorithm.lam=1",
                                         "fedproto algorithm.lam=10", "fedtgp algorithm.lam=1 data.partition.beta=0.5"]
    assert [len(g.runs) for g in groups] == [1, 2, 1, 1] and superseded == []
    # an option two methods set differently is no key: each method has one value of it
    assert cmp.grouping_keys([_rs("x", "fedtgp", 0, **{"algorithm.lam": 1}), _rs("y", "fedproto", 0)]) == []
    # a later run of the same group and seed supersedes the earlier one
    groups, _, superseded = cmp.group_runs([_rs("old", "fedavg", 0, start=1), _rs("new", "fedavg", 0, start=2),
                                            _rs("s1", "fedavg", 1, start=3)])
    assert [r.run_id for r in groups[0].runs] == ["new", "s1"]
    assert [lo.run_id for lo in superseded] == ["old"] and "superseded by the later run new" in superseded[0].reason


def test_one_seed_has_no_std():
    assert cmp.format_stat(cmp.Stat.of([0.5]), True) == "50.0"
    assert cmp.format_stat(cmp.Stat.of([0.5, 0.7]), True) == "60.0 ± 10.0"
    assert cmp.format_stat(cmp.Stat.of([]), True) == "n/a"
    assert cmp.format_stat(cmp.Stat.of([2.0, 4.0]), False) == "3 ± 1"


def test_bad_input_is_named(store, tmp_path):
    uri, _ = store
    with pytest.raises(InputError, match=r"unknown experiment 'nope' at sqlite.*experiments there: .*cmp_a, cmp_b"):
        cmp.compare(["cmp_a", "nope"], tracking_uri=uri)
    with pytest.raises(InputError, match=r"nothing to compare.*eval/head_accuracy(.|\n)*metrics these runs have: "
                                         r".*eval/head_acc"):
        cmp.compare(["cmp_a"], tracking_uri=uri, metric="eval/head_accuracy")
    with pytest.raises(InputError, match="mode 'best'"):
        cmp.compare(["cmp_a"], tracking_uri=uri, mode="best")
    missing = tmp_path / "none" / "mlflow.db"
    with pytest.raises(InputError, match="no MLflow store at"):
        cmp.compare(["cmp_a"], tracking_uri=f"sqlite:///{missing}")
    assert not missing.exists()  # reading never creates a store


def test_cli_end_to_end_logs_a_comparison_run(store, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from rayfed_proto.cli import main

    uri, ids = store
    out = tmp_path / "cmp"
    assert main(["compare", "cmp_a", "cmp_b", "--tracking-uri", uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fedavg | 3 (0, 1, 2) | 60.0 ± 8.2 |" in printed and f"run {ids['running']}" in printed
    assert "MLflow: comparison run" in printed
    files = {p.name for p in out.iterdir()}
    assert files == {"comparison.csv", "comparison.md", "left_out.csv", "eval_head_acc_vs_version.png",
                     "eval_head_acc_vs_sim_time.png"}

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("rayfed_proto_compare")
    (run,) = client.search_runs([exp.experiment_id], "tags.rfp.role = 'parent'")
    assert run.info.status == "FINISHED" and run.data.tags["rayfed_proto.compare"] == "1"
    assert run.data.params["experiments"] == "cmp_a, cmp_b" and run.data.params["runs_left_out"] == "6"
    assert "| fedproto | 3 (0, 1, 2) |" in run.data.tags["mlflow.note.content"]
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"comparison.csv", "comparison.md", "left_out.csv", "plots", "tables"} <= top
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/eval_head_acc_vs_version.png", "plots/eval_head_acc_vs_sim_time.png"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "tables")} == {"tables/comparison.json"}
    # issue 49: one nested run per group, the same metric names (the mean over seeds per version, the
    # std beside it), so that MLflow draws the groups in one chart; the parent sorts by the best group's final mean
    groups = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    by_name = {g.info.run_name: g for g in groups}
    assert sorted(by_name) == ["fedavg", "fedproto"]
    for g in groups:
        assert g.info.status == "FINISHED" and g.data.tags["rfp.role"] == "comparison" and "rayfed_proto.compare" in g.data.tags
        assert g.data.params["seeds"] == "0,1,2" and g.data.params["n_seeds"] == "3"
    fedavg, fedproto = by_name["fedavg"], by_name["fedproto"]
    assert fedavg.data.params["algorithm.name"] == "fedavg"
    assert set(fedavg.data.metrics) == {"eval/head_acc", "eval/head_acc_seed_std"}
    assert set(fedproto.data.metrics) == {"eval/head_acc", "eval/head_acc_seed_std", "eval/proto_acc",
                                          "eval/proto_acc_seed_std"}
    mean = {m.step: m.value for m in client.get_metric_history(fedavg.info.run_id, "eval/head_acc")}
    std = {m.step: m.value for m in client.get_metric_history(fedavg.info.run_id, "eval/head_acc_seed_std")}
    assert sorted(mean) == sorted(std) == list(STEPS)
    assert mean[15] == pytest.approx(sum(v[2] for v in FEDAVG.values()) / 3)
    assert std[15] == pytest.approx(_std(*(v[2] for v in FEDAVG.values())))
    proto = {m.step: m.value for m in client.get_metric_history(fedproto.info.run_id, "eval/proto_acc")}
    assert proto == {15: pytest.approx(sum(PROTO.values()) / 3)}
    # FedProto's mean final head accuracy (0.85) beats FedAvg's (0.60): the parent's eval/head_acc, at the last version
    (best,) = client.get_metric_history(run.info.run_id, "eval/head_acc")
    assert (best.value, best.step) == (pytest.approx(sum(v[2] for v in FEDPROTO.values()) / 3), 15)
    assert set(run.data.metrics) == {"eval/head_acc"}
    note = run.data.tags["mlflow.note.content"]
    assert "[Compare the groups](#/compare-runs?runs=" in note and "workflowType=machine_learning" in note
    assert "MLflow: comparison run" in printed and "workflowType=machine_learning" in printed

    # a comparison run is never compared itself; --no-log logs nothing more
    assert main(["compare", "cmp_a", "rayfed_proto_compare", "--tracking-uri", uri, "--out", str(tmp_path / "2"),
                 "--no-log"]) == 0
    out2 = capsys.readouterr().out
    assert f"run {run.info.run_id}" in out2 and f"run {fedavg.info.run_id}" in out2
    assert len(client.search_runs([exp.experiment_id])) == 3


def test_cli_unknown_experiment_exits_2(store, capsys):
    from rayfed_proto.cli import main

    uri, _ = store
    assert main(["compare", "nope", "--tracking-uri", uri, "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown experiment 'nope'" in err and "cmp_a, cmp_b" in err


def test_paper_metric_comparison_charts_every_method_under_one_key(store, tmp_path):
    """--metric paper: each group's own paper metric, logged under one key (eval/paper_metric) so the
    methods share a chart; the key each group was read at is its param."""
    from mlflow.tracking import MlflowClient

    uri, _ = store
    comp = cmp.compare(["cmp_b"], tracking_uri=uri, metric=cmp.PAPER)
    parent = cmp.log_comparison(comp, cmp.write_outputs(comp, tmp_path), "paper_cmp")
    client = MlflowClient(uri)
    (group,) = client.search_runs([client.get_experiment_by_name("paper_cmp").experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")
    assert group.data.params["paper_metric"].startswith("eval/proto_acc")
    assert set(group.data.metrics) == {"eval/paper_metric", "eval/paper_metric_seed_std"}
    assert group.data.metrics["eval/paper_metric"] == pytest.approx(sum(PROTO.values()) / 3)
    assert group.data.metrics["eval/paper_metric_seed_std"] == pytest.approx(_std(*PROTO.values()))
