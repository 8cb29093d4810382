"""Each method's paper metric (tracking/paper_metric.py), the one final-and-best reduction, the
seed summary reporting it (and eval/global_acc), and ``compare --metric paper`` (issue 47, item 8b)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from test_compare import Store, _std

from rayfed_proto.runtime import seeds
from rayfed_proto.tracking import compare as cmp
from rayfed_proto.tracking.paper_metric import PAPER_METRICS, final_and_best, paper_metric

NAN = math.nan


def test_final_and_best_skip_non_finite_values():
    assert final_and_best([NAN, 0.5, 0.7, 0.6]) == (0.6, 0.7)
    assert final_and_best([NAN, 0.5, 0.7, 0.6], "min") == (0.6, 0.5)
    assert final_and_best([0.4, math.inf, NAN]) == (0.4, 0.4)
    f, b = final_and_best([NAN])
    assert math.isnan(f) and math.isnan(b)
    with pytest.raises(ValueError, match="mode 'top': allowed max .* or min"):
        final_and_best([0.1], "top")


def test_each_papers_metric_and_statistic():
    assert tuple(paper_metric("fedsa")) == ("eval/proto_acc", "best")  # HtFLlib: best over per-round evaluations
    assert tuple(paper_metric("fedtgp")) == ("eval/proto_acc", "best")
    assert tuple(paper_metric("fedproto")) == ("eval/proto_acc", "best")
    assert tuple(paper_metric("fedsc")) == ("eval/global_acc", "final")  # Table 3: final test accuracy
    assert tuple(paper_metric("fedprotokd")) == ("eval/global_acc", "best")  # server accuracy
    assert paper_metric("fedlsa").keys == ("eval/global_acc_domain_mean", "eval/global_acc")
    assert paper_metric("fedlsa").key_in(["eval/head_acc", "eval/global_acc"]) == "eval/global_acc"
    assert tuple(paper_metric("someone_elses")) == ("eval/head_acc", "final")
    assert all(pm.source for pm in PAPER_METRICS.values())  # every choice names where it comes from


# ----------------------------------------------------------------------------- the seed summary


def _group(tmp_path, algorithm: str, histories: dict[int, dict[str, list[float]]]) -> seeds.SeedGroup:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": algorithm}}))
    records = {}
    for seed, columns in histories.items():
        folder = tmp_path / f"seed-{seed}" / "run"
        folder.mkdir(parents=True)
        pd.DataFrame({"version": range(len(next(iter(columns.values())))), **columns}).to_parquet(folder / "history.parquet")
        records[seed] = seeds.SeedRecord("finished", str(folder), run_id=f"r{seed}", final_version=3)
    return seeds.SeedGroup(tmp_path, list(histories), "g", None, None, "e", records)


FEDSC_HISTORIES = {0: {"eval/head_acc": [0.1, 0.2, 0.3, 0.25], "eval/global_acc": [NAN, 0.5, 0.7, 0.6]},
                   1: {"eval/head_acc": [0.2, 0.3, 0.4, 0.35], "eval/global_acc": [NAN, 0.4, 0.8, 0.8]}}


def test_seed_summary_reports_global_acc_and_the_papers_metric(tmp_path):
    group = _group(tmp_path, "fedsc", FEDSC_HISTORIES)
    seeds._summarise(group)
    # global_acc: seed 0 final 0.6 best 0.7, seed 1 final 0.8 best 0.8
    assert group.per_seed.loc[0, "eval/global_acc_final"] == 0.6 and group.per_seed.loc[0, "eval/global_acc_best"] == 0.7
    assert group.stats.loc["mean", "eval/global_acc_final"] == pytest.approx(0.7)
    assert group.stats.loc["std", "eval/global_acc_final"] == pytest.approx(0.1)  # population std
    assert group.stats.loc["mean", "eval/head_acc_best"] == pytest.approx(0.35)
    assert "eval/proto_acc_final" not in group.per_seed.columns  # logged by no seed: no column
    assert "eval/global_acc (final)" in group.summary
    assert seeds.paper_metric_column(group)[0] == "eval/global_acc_final"
    line = [ln for ln in group.summary.splitlines() if ln.startswith("paper metric:")]
    assert line == [f"paper metric: eval/global_acc (final) = 70.00% ± 10.00% over 2 seeds ({paper_metric('fedsc').source})"]


def test_seed_summary_with_chosen_metrics(tmp_path):
    group = seeds.summarise(_group(tmp_path, "fedsc", FEDSC_HISTORIES), ["eval/global_acc"])
    assert [c for c in group.per_seed.columns if c.startswith("eval/")] == ["eval/global_acc_final", "eval/global_acc_best"]
    assert group.stats.loc["mean", "eval/global_acc_best"] == pytest.approx(0.75)


def test_no_paper_metric_line_when_the_seeds_did_not_log_it(tmp_path):
    group = _group(tmp_path, "fedsa", {0: {"eval/head_acc": [0.1, 0.2]}})  # FedSA's paper metric is proto_acc
    seeds._summarise(group)
    assert seeds.paper_metric_column(group) is None and "paper metric:" not in group.summary


# ----------------------------------------------------------------------------- compare --metric paper

FEDSA = {0: ((0.5, 0.6, 0.55), (0.6, 0.9, 0.8)), 1: ((0.4, 0.5, 0.6), (0.7, 0.8, 0.85))}  # (head, proto) per step
FEDSC = {0: ((0.3, 0.4, 0.5), (0.6, 0.7, 0.65)), 1: ((0.3, 0.5, 0.4), (0.5, 0.8, 0.75))}  # (head, global)
STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def paper_store(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    exp = st.client.create_experiment("cmp_paper")
    for algorithm, runs, second in (("fedsa", FEDSA, "eval/proto_acc"), ("fedsc", FEDSC, "eval/global_acc")):
        for seed, (head, other) in runs.items():
            metrics = [("eval/head_acc", v, s) for s, v in zip(STEPS, head, strict=True)]
            metrics += [(second, v, s) for s, v in zip(STEPS, other, strict=True)]
            st.run(f"{algorithm}{seed}", exp, {"algorithm.name": algorithm, "seed": str(seed)}, metrics)
    st.run("fedsc_no_global", exp, {"algorithm.name": "fedsc", "seed": "2"}, [("eval/head_acc", 0.9, 1)])
    return st.uri, dict(st.ids)


def test_compare_paper_reads_each_method_at_its_paper_metric(paper_store):
    uri, ids = paper_store
    comp = cmp.compare(["cmp_paper"], tracking_uri=uri, metric="paper")
    fedsa, fedsc = comp.groups
    assert (fedsa.paper_key(), fedsc.paper_key()) == ("eval/proto_acc", "eval/global_acc")
    # FedSA: best proto_acc 0.9 and 0.85; FedSC: final global_acc 0.65 and 0.75
    assert fedsa.paper_figure().mean == pytest.approx(0.875) and fedsa.paper_figure().std == pytest.approx(0.025)
    assert fedsc.paper_figure().mean == pytest.approx(0.7) and fedsc.paper_figure().std == pytest.approx(_std(0.65, 0.75))
    reasons = {lo.run_id: lo.reason for lo in comp.left_out}
    assert reasons[ids["fedsc_no_global"]] == "no paper metric (eval/global_acc)"
    md = comp.markdown()
    assert "| fedsa | 2 (0, 1) | eval/proto_acc (best) | 87.5 ± 2.5 |" in md
    assert "| fedsc | 2 (0, 1) | eval/global_acc (final) | 70.0 ± 5.0 |" in md
    row = {r["group"]: r for r in comp.rows()}["fedsc"]
    assert row["paper metric"] == "eval/global_acc (final)" and row["paper figure mean"] == pytest.approx(0.7)


def test_compare_on_head_accuracy_reports_global_acc_beside_it(paper_store):
    uri, _ = paper_store
    comp = cmp.compare(["cmp_paper"], tracking_uri=uri)
    assert comp.extras == ["eval/proto_acc", "eval/global_acc"]
    fedsc = comp.groups[1]
    assert fedsc.final("eval/global_acc").mean == pytest.approx(0.7)
    assert fedsc.best("max", "eval/global_acc").mean == pytest.approx(np.mean([0.7, 0.8]))
