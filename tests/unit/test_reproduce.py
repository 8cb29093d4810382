"""``rayfed-proto reproduce`` (issue 47 item 9): the published tables, the plan per scale, the
table beside the paper's numbers, and the errors. No Ray: the plan is built and checked only."""

import math

import pandas as pd
import pytest

from rayfed_proto.cli import main
from rayfed_proto.config import ConfigError
from rayfed_proto.reproduce import runner
from rayfed_proto.reproduce.metrics import history_value, paper_metric
from rayfed_proto.reproduce.published import PAPERS, TABLES, entries
from rayfed_proto.reproduce.settings import MAIN_TABLE, REPRODUCTIONS

# ------------------------------------------------------------------------------ published numbers


def test_every_published_number_names_its_paper_table_column_row_metric_and_source():
    found = list(entries())
    assert len(found) > 300
    for e in found:
        assert e.paper in PAPERS and e.table and e.column and e.row and e.metric
        assert e.source.startswith(PAPERS[e.paper]) and f"../shared/papers/{e.paper}.md" in e.source
        assert 0.0 <= e.value <= 100.0 and (e.std is None or e.std >= 0.0)
    for t in TABLES.values():
        assert all(len(cells) == len(t.columns) for cells in t.rows.values()), t.label
        assert len(set(t.columns)) == len(t.columns)


@pytest.mark.parametrize("paper, table, row, column, value, std", [
    ("fedsa", "table2", "FedSA", "HtFE8", 35.68, 0.17),
    ("fedsa", "table2", "FedProto", "HtFE2", 35.63, 0.22),
    ("fedsa", "table1", "FedTGP", "cross-device/Cifar100", 47.41, 0.11),
    ("fedlsa", "table2", "FedLSA", "Digits/SYN", 30.95, None),
    ("fedlsa", "table2", "FedAvg", "Digits/AVERAGE", 60.89, None),
    ("fedprotokd", "table2", "FedProtoKD", "alpha=0.1/CIFAR-10", 88.52, None),
    ("fedprotokd", "table1", "FedProtoKD", "k=5|40/CIFAR-100", 30.29, None),
    ("fedsc", "table1", "FedSC", "CIFAR10/NID1_0.2", 88.13, None),
    ("fedsc", "table2", "FedProto", "CIFAR100-LT/rho=200", 25.79, None),
    ("fedsap", "table1", "FedSAP (proto)", "CIFAR-100/n=30", 75.43, 0.89),
    ("fedsap", "table1", "FedAvg (head)", "FEMNIST/n=3", 33.60, 15.12),
])
def test_published_cells_as_printed(paper, table, row, column, value, std):
    assert TABLES[(paper, table)].cell(row, column) == (value, std)


def test_every_reproduction_matches_its_published_table():
    assert set(MAIN_TABLE) == set(PAPERS) and all((p, t) in REPRODUCTIONS for p, t in MAIN_TABLE.items())
    for r in REPRODUCTIONS.values():
        pub = r.published
        assert [c.name for c in r.columns] == list(pub.columns)
        assert set(r.small_columns) <= set(pub.columns)
        assert all(row in pub.rows for m in r.methods for row in m.rows)
        assert all(c.setting in r.settings for c in r.columns)
        assert all(s.unavailable for s in r.settings.values() if s.full is None)


def test_reproduce_reads_the_platforms_paper_metric():
    """One home for "the metric a paper reports" (tracking/paper_metric.py)."""
    from rayfed_proto.tracking import paper_metric as home

    assert paper_metric is home.paper_metric
    assert tuple(paper_metric("fedsa")) == ("eval/proto_acc", "best")
    assert tuple(paper_metric("fedprotokd")) == ("eval/global_acc", "best")  # server accuracy, Sec. IV-E


def test_history_value_best_and_final():
    h = pd.DataFrame({"version": [1, 2, 3, 4], "eval/proto_acc": [0.5, 0.8, math.nan, 0.7]})
    assert history_value(h, "eval/proto_acc", "best") == 0.8
    assert history_value(h, "eval/proto_acc", "final") == 0.7
    assert math.isnan(history_value(h, "eval/global_acc", "final"))


# ------------------------------------------------------------------------------ list and plan


def test_list_names_every_table(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for paper, table in REPRODUCTIONS:
        assert any(line.split()[:2] == [paper, table] or line.split()[1:3] == [paper, table]
                   for line in out.splitlines()), (paper, table)


@pytest.mark.parametrize("key", sorted(REPRODUCTIONS))
def test_plan_at_each_scale_builds_every_config(key):
    paper, table = key
    small = runner.make_plan(paper, table, scale="small")
    full = runner.make_plan(paper, table, scale="full")
    assert small.seeds == full.seeds == [0, 1, 2]
    assert small.columns == list(REPRODUCTIONS[key].small_columns)
    for run in small.runs:  # a CPU's minutes: embedded data, few rounds and clients
        cfg = run.config
        assert cfg.data.name in ("digits", "digits_domains", "synthetic")
        # the global-model papers (FedSC, FedLSA) run 20: FedAvg's global model is at chance for the first rounds
        assert cfg.federation.rounds == (20 if paper in ("fedsc", "fedlsa") else 6) and cfg.federation.num_clients == 6
        assert cfg.algorithm.name == run.method.algorithm
    for run in full.runs:  # the paper's data and rounds
        assert run.config.data.name not in ("digits", "digits_domains", "synthetic")
        assert run.config.federation.rounds >= 100
    assert set(full.columns) | set(full.skipped) == set(REPRODUCTIONS[key].published.columns)


def test_fedsa_plan_runs_baselines_with_their_own_options():
    plan = runner.make_plan("fedsa", "table2", scale="full")
    by_method = {run.method.algorithm: run.config for run in plan.runs if run.columns == ("HtFE8",)}
    assert set(by_method) == {"fedproto", "fedtgp", "fedsa"}
    assert by_method["fedproto"].algorithm.lam == 10.0  # the FedSA / FedTGP scripts
    assert by_method["fedsa"].algorithm.lambda2 == 1.0  # the preset's own section
    assert all(cfg.model.group == "HtFE8" and cfg.federation.num_clients == 100 for cfg in by_method.values())
    t1 = runner.make_plan("fedsa", "table1", scale="full", columns=["cross-silo/Cifar10"], methods=["fedsa"])
    (run,) = t1.runs
    assert run.config.algorithm.lambda2 == 0.01 and run.config.data.name == "cifar10"
    assert run.config.model.group == "HtFE1" and run.config.federation.num_clients == 20


def test_fedlsa_columns_read_each_domain_of_one_run():
    plan = runner.make_plan("fedlsa", scale="small")
    assert [run.method.algorithm for run in plan.runs] == ["fedavg", "fedlsa"]  # one run per method for five columns
    r = plan.reproduction
    fedavg = r.methods[0]
    assert runner.cell_metric(r, "small", fedavg, "FedAvg", "Digits/MNIST") == ("eval/global_acc_original", "final")
    assert runner.cell_metric(r, "full", fedavg, "FedAvg", "Digits/SYN") == ("eval/global_acc_synth", "final")
    assert runner.cell_metric(r, "full", fedavg, "FedAvg", "Digits/AVERAGE") == ("eval/global_acc_domain_mean", "final")
    fedlsa = r.methods[1]  # its paper metric is the domain mean itself: a domain's column reads that domain
    assert runner.cell_metric(r, "small", fedlsa, "FedLSA", "Digits/MNIST") == ("eval/global_acc_original", "final")
    assert runner.cell_metric(r, "small", fedlsa, "FedLSA", "Digits/AVERAGE") == ("eval/global_acc_domain_mean", "final")


def test_dry_run_prints_the_runs_without_ray(capsys, monkeypatch):
    import ray

    def no_ray(*a, **k):
        raise AssertionError("a dry run started Ray")

    # the suite's integration tests may have left their shared instance up: the dry run must not
    # call ray.init (nor anything that would), whatever state Ray is in
    monkeypatch.setattr(ray, "init", no_ray)
    was = ray.is_initialized()
    assert main(["reproduce", "fedsc", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 seed groups x 3 seeds (0, 1, 2) = 9 runs" in out and "NOT the paper's experiment" in out
    assert "fedsc on fedsc_domains -> CIFAR10/NID1_0.2" in out
    assert ray.is_initialized() == was


# ------------------------------------------------------------------------------ the table


def _hand_made():
    plan = runner.make_plan("fedsa", "table2", scale="small", seeds=[0, 1, 2])
    values = {("FedSA", "HtFE8"): [0.5, 0.6, 0.7], ("FedTGP", "HtFE8"): [0.3]}
    return plan, runner.result_rows(plan, values)


def test_table_rows_mean_std_and_difference():
    _, rows = _hand_made()
    by_row = {r["row"]: r for r in rows}
    assert list(by_row) == ["FedProto", "FedTGP", "FedSA"]
    sa = by_row["FedSA"]
    assert sa["column"] == "HtFE8" and sa["table"] == "Table 2" and sa["metric"] == "eval/proto_acc (best)"
    assert sa["paper_value"] == 35.68 and sa["paper_std"] == 0.17 and sa["n"] == 3
    assert sa["ours_mean"] == pytest.approx(60.0)
    assert sa["ours_std"] == pytest.approx(100 * math.sqrt(((0.1) ** 2 * 2) / 3))  # population std: 8.165
    assert sa["difference"] == pytest.approx(60.0 - 35.68)
    assert by_row["FedTGP"]["n"] == 1 and math.isnan(by_row["FedTGP"]["ours_std"])  # no spread from one seed
    assert by_row["FedProto"]["n"] == 0 and math.isnan(by_row["FedProto"]["difference"])


def test_markdown_and_csv(tmp_path):
    plan, rows = _hand_made()
    md = runner.format_markdown(plan, rows, ["fedproto on HtFE8: boom"])
    assert "Small scale, NOT the paper's experiment" in md and "Table 2" in md and "FAILED: fedproto on HtFE8: boom" in md
    assert "| HtFE8 | FedSA | eval/proto_acc (best) | 35.68 ± 0.17 | 60.00 ± 8.16 (3) | +24.32 |" in md
    assert "| HtFE8 | FedTGP | eval/proto_acc (best) | 32.04 ± 0.74 | 30.00 (1) | -2.04 |" in md
    assert "| HtFE8 | FedProto | eval/proto_acc (best) | 16.31 ± 0.32 | - | - |" in md
    files = runner.write_outputs(rows, md, tmp_path)
    csv = pd.read_csv(files["csv"])
    assert list(csv.columns) == ["paper", "table", "column", "row", "algorithm", "scale", "metric", "paper_value",
                                 "paper_std", "ours_mean", "ours_std", "n", "difference"]
    assert csv.loc[csv["row"] == "FedSA", "difference"].item() == pytest.approx(24.32)
    assert files["markdown"].read_text() == md + "\n"


def test_metric_key_keeps_mlflow_characters():
    assert runner.metric_key("reproduce", "FedSAP (head)", "k=3|20/CIFAR-10", "ours_mean") == \
        "reproduce/FedSAP _head_/k_3_20_CIFAR-10/ours_mean"


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("argv, says", [
    (["reproduce", "fedx"], "PAPER = 'fedx': fedsa, fedlsa, fedprotokd, fedsc, fedsap"),
    (["reproduce"], "PAPER = None: fedsa, fedlsa"),
    (["reproduce", "fedsa", "table9"], "TABLE = 'table9': for fedsa: table2, table1"),
    (["reproduce", "fedsa", "--columns", "HtFE9"], "--columns = 'HtFE9': columns of fedsa table2: HtFE2, HtFE3"),
    (["reproduce", "fedsa", "table1", "--scale", "full", "--columns", "cross-silo/Tiny-ImageNet"],
     "Tiny-ImageNet is not a dataset of this platform"),
    (["reproduce", "fedsa", "--methods", "fedavg"], "--methods = 'fedavg': methods of fedsa table2: fedproto, fedtgp, fedsa"),
    (["reproduce", "fedsa", "--seeds", "1", "1"], "repeated: 1"),
    (["reproduce", "fedsa", "--set", "seed=3"], "seed = 3"),
    (["reproduce", "fedsa", "--set", "federation.rounds=-1"], "federation.rounds"),
])
def test_bad_input_exits_2_naming_what_is_allowed(argv, says, capsys):
    assert main([*argv, "--dry-run"]) == 2
    assert says in capsys.readouterr().err


def test_unknown_scale_from_the_api():
    with pytest.raises(ConfigError, match="--scale = 'huge': small, full"):
        runner.make_plan("fedsa", scale="huge")


def test_fedprotokd_tables_read_the_server_and_the_clients_accuracy():
    """TABLE I is the server model's accuracy, TABLE II the clients' personalised accuracy (Sec. IV-E)."""
    for table, want in (("table1", ("eval/global_acc", "best")), ("table2", ("eval/head_acc", "best"))):
        r = runner.make_plan("fedprotokd", table, scale="small").reproduction
        kd = next(m for m in r.methods if m.algorithm == "fedprotokd")
        assert tuple(runner.cell_metric(r, "small", kd, "FedProtoKD", "alpha=0.1/CIFAR-10")) == want
