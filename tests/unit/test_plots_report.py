"""Run plots and the text summary: valid PNGs for normal, 1-point and prototype-free histories; exact table values."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking.plots import (
    plot_accuracy_vs_version,
    plot_accuracy_vs_wall_time,
    plot_label_distribution,
    plot_prototype_margin,
    plot_prototypes_2d,
)
from rayfed_proto.tracking.report import (
    format_summary_table,
    history_to_frame,
    human_bytes,
    human_duration,
    summary_rows,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


def _entry(version: int, head: float, proto: float = NAN, **more: float) -> dict[str, float]:
    """A history row under the names the runtime gives its metrics; ``more``: extra or changed
    values by their old flat name (a shorthand here: keyword names cannot hold a ``/``)."""
    row = {"version": version, "federation/wall_s": 2.5 * version, "eval/head_acc": head,
           "eval/head_acc_mean": head - 0.01, "eval/head_acc_std": 0.05, "eval/proto_acc": proto,
           "server/proto_margin_min": 1.0 + 0.1 * version, "server/proto_margin_mean": 2.0 + 0.1 * version,
           "train/loss": 1.0 / version, "federation/bytes_up": 1000 * version, "federation/bytes_down": 4000 * version,
           "federation/staleness_mean": 0.5, "federation/staleness_max": 2, "federation/updates_dropped": 0,
           "federation/updates_refused": 0, "federation/client_busy_s": 3.0 * version, "server/train_s": 0.5 * version,
           "federation/slot_utilisation": 0.9}
    row.update({names.mlflow_key(k): v for k, v in more.items()})
    return row


NORMAL = [_entry(v, 0.3 + 0.04 * v, 0.25 + 0.04 * v) for v in range(1, 16)]
NORMAL[0][names.EVAL_PROTO_ACC] = NAN  # no prototype bank yet at the first evaluation
NORMAL[3].pop(names.EVAL_HEAD_ACC_STD)  # a gap in the band
ONE_POINT = [_entry(5, 0.4, 0.35)]
NO_PROTO = [_entry(v, 0.5 + 0.02 * v, proto_margin_min=NAN, proto_margin_mean=NAN) for v in range(1, 6)]
HISTORIES = {"normal": NORMAL, "one_point": ONE_POINT, "no_proto": NO_PROTO, "empty": []}


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 1024
    height, width = mpimg.imread(path).shape[:2]  # decodes: the file is complete
    assert height > 100 and width > 100


@pytest.mark.parametrize("name", sorted(HISTORIES))
@pytest.mark.parametrize("plot", [plot_accuracy_vs_version, plot_accuracy_vs_wall_time, plot_prototype_margin])
def test_history_plots_write_png(tmp_path: Path, plot, name: str) -> None:
    target = tmp_path / "nested" / f"{name}.png"
    out = plot(HISTORIES[name], target)
    assert out == target
    _assert_png(out)


def test_plots_leave_no_pyplot_figures(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    plot_accuracy_vs_version(NORMAL, tmp_path / "a.png", title="custom title")
    plot_label_distribution(np.ones((2, 3)), tmp_path / "b.png")
    plot_prototypes_2d([0, 1], np.eye(2), tmp_path / "c.png")
    assert set(plt.get_fignums()) == before


@pytest.mark.parametrize("shape", [(3, 4), (500, 100)])
def test_label_distribution_png(tmp_path: Path, shape: tuple[int, int]) -> None:
    counts = np.random.default_rng(0).integers(0, 50, size=shape)
    names = [f"c{j}" for j in range(shape[1])]
    _assert_png(plot_label_distribution(counts, tmp_path / "labels.png", class_names=names))


def test_label_distribution_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_label_distribution(np.ones(4), tmp_path / "x.png")
    with pytest.raises(ValueError):
        plot_label_distribution(np.ones((2, 3)), tmp_path / "x.png", class_names=["a", "b"])


@pytest.mark.parametrize("n", [0, 1, 5])
def test_prototypes_2d_png(tmp_path: Path, n: int) -> None:
    vectors = np.random.default_rng(1).normal(size=(n, 16))
    names = {c: f"digit {c}" for c in range(10)}
    _assert_png(plot_prototypes_2d(list(range(n)), vectors, tmp_path / "protos.png", class_names=names))


def test_prototypes_2d_checks_alignment(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_prototypes_2d([0, 1, 2], np.zeros((2, 4)), tmp_path / "x.png")


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(1024) == "1.0 KiB"
    assert human_bytes(3 * 1024**2) == "3.0 MiB"
    assert human_bytes(1.25 * 1024**3) == "1.2 GiB"  # one decimal, round-half-even as Python formats
    assert human_bytes(1024**2 - 1) == "1.0 MiB"  # never "1024.0 KiB"
    assert human_bytes(NAN) == "n/a"


def test_human_duration() -> None:
    assert human_duration(3.2) == "3.2s"
    assert human_duration(0) == "0.0s"
    assert human_duration(59.97) == "1m 00s"
    assert human_duration(125) == "2m 05s"
    assert human_duration(3725) == "1h 02m 05s"
    assert human_duration(NAN) == "n/a"


def test_summary_best_is_not_last() -> None:
    history = [_entry(5, 0.50, 0.40), _entry(10, 0.80, 0.75), _entry(15, 0.70, 0.60),
               _entry(20, 0.80, 0.50, wall_s=125.0, bytes_up=1536, bytes_down=3 * 1024**2, staleness_max=7,
                      updates_dropped=3, updates_refused=1, slot_utilisation=0.934)]
    rows = dict(summary_rows(history))
    assert rows["head accuracy (best)"] == "80.00% @ v10"  # first time the maximum is reached
    assert rows["head accuracy (final)"] == "80.00% @ v20"
    assert rows["prototype accuracy (best)"] == "75.00% @ v10"
    assert rows["prototype accuracy (final)"] == "50.00% @ v20"
    assert rows["per-client head accuracy (final)"] == "79.00% ± 5.00% @ v20"
    assert rows["prototype margin (final)"] == "min 3.000 / mean 4.000 @ v20"
    assert rows["server versions"] == "20"
    assert rows["evaluations"] == "4"
    assert rows["wall time"] == "2m 05s"
    assert rows["bytes up / down"] == "1.5 KiB / 3.0 MiB"
    assert rows["staleness mean / max (versions)"] == "0.50 / 7"
    assert rows["updates dropped / refused"] == "3 / 1"
    assert rows["slot utilisation"] == "93.4%"


def test_summary_without_prototypes() -> None:
    labels = [label for label, _ in summary_rows(NO_PROTO)]
    assert "head accuracy (final)" in labels
    assert not [label for label in labels if "prototype" in label]
    absent = [{"version": 1, names.EVAL_HEAD_ACC: 0.5}]
    assert [label for label, _ in summary_rows(absent)] == [
        "head accuracy (final)", "head accuracy (best)", "server versions", "evaluations"]


def test_summary_table_layout() -> None:
    table = format_summary_table(NORMAL, title="FedProto on MNIST",
                                 extra={"algorithm": "fedproto", "mlflow run id": "abc123", "lr": 0.01})
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1  # fixed width
    assert lines[0].startswith("+-") and lines[-1].startswith("+-")
    assert all(line[0] in "+|" and line[-1] in "+|" for line in lines)
    assert "FedProto on MNIST" in lines[1]
    text = "\n".join(lines)
    assert text.index("fedproto") < text.index("abc123") < text.index("head accuracy (final)")
    assert "| lr " in text and "0.01" in text
    assert "90.00% @ v15" in text


def test_summary_table_empty_history() -> None:
    table = format_summary_table([], title="a title much longer than any row in the table")
    assert "| evaluations | 0" in table
    assert len({len(line) for line in table.splitlines()}) == 1


def test_history_to_frame() -> None:
    frame = history_to_frame([{"federation/wall_s": 1.0, "version": 1, "eval/head_acc": 0.5},
                              {"version": 2, "federation/bytes_up": 10}])
    assert list(frame.columns) == ["version", "eval/head_acc", "federation/bytes_up", "federation/wall_s"]
    assert frame["version"].tolist() == [1, 2]
    assert math.isnan(frame.loc[1, "eval/head_acc"])
    assert history_to_frame([]).empty


def test_summary_shows_global_accuracy_and_failures_only_when_present():
    from rayfed_proto.tracking.report import summary_rows

    plain = dict(summary_rows([{"version": 1, names.EVAL_HEAD_ACC: 0.5}]))
    assert not any(k.startswith("global") for k in plain) and "failures survived" not in plain
    rows = dict(summary_rows([{"version": 1, names.EVAL_HEAD_ACC: 0.5, names.EVAL_GLOBAL_ACC: 0.25,
                               names.EVAL_GLOBAL_ACC_DOMAIN_MEAN: 0.2, names.RELIABILITY_CLIENT_FAILURES: 2,
                               names.RELIABILITY_SERVER_RESTARTS: 0, names.RELIABILITY_CLIENTS_EXCLUDED: 1}]))
    assert rows["global model accuracy (final)"] == "25.00% @ v1"
    assert rows["global model, domain mean (final)"] == "20.00% @ v1"
    assert rows["failures survived"] == "client actor failures 2, clients excluded 1"  # zero counts left out


def _timed(version: int, head: float) -> dict[str, float]:
    return {**_entry(max(version, 1), head, sim_time_s=100.0 * version, wall_s=2.5 * version), "version": version}


def test_time_to_target_is_the_first_evaluation_that_reaches_it() -> None:
    from rayfed_proto.tracking.report import time_to_target

    history = [_timed(0, 0.1), _timed(2, 0.5), _timed(4, 0.81), _timed(6, 0.79), _timed(8, 0.9)]
    assert time_to_target(history, 0.8) == (400.0, 4)
    assert time_to_target(history, 0.8, time_key=names.FEDERATION_WALL_S) == (10.0, 4)  # wall_s = 2.5 x version
    assert time_to_target(history, 0.5) == (200.0, 2)  # reaching exactly counts
    assert time_to_target(history, 0.95) is None


def test_summary_reports_simulated_time_and_time_to_target() -> None:
    history = [_timed(0, 0.1), _timed(2, 0.5), _timed(4, 0.81)]
    rows = dict(summary_rows(history, target_accuracy=0.8))
    assert rows["simulated time"] == "6m 40s"
    assert rows["time to 80.00% head accuracy"] == "simulated 6m 40s @ version 4, wall 10.0s @ version 4"
    assert dict(summary_rows(history, target_accuracy=0.9))["time to 90.00% head accuracy"] == "not reached"
    untimed = [{**_entry(1, 0.1, wall_s=0.0), "version": 0}, _entry(1, 0.9)]  # wall-clock run: no simulated rows
    rows = dict(summary_rows(untimed, target_accuracy=0.8))
    assert "simulated time" not in rows and rows["time to 80.00% head accuracy"] == "wall 2.5s @ version 1"
    assert "time to" not in " ".join(dict(summary_rows(history)))  # no target: no row


def test_sim_time_and_participation_plots_write_png(tmp_path: Path) -> None:
    import pandas as pd

    from rayfed_proto.tracking.plots import plot_accuracy_vs_sim_time, plot_client_updates

    path = plot_accuracy_vs_sim_time([_timed(0, 0.1), _timed(2, 0.6)], tmp_path / "sim.png", target=0.5)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    frame = pd.DataFrame({"client_id": [0, 1, 2], "updates": [5, 2, 0], "speed": [2.0, 0.5, 0.1],
                          "compute_s": [1.0, 4.0, 20.0]})
    for f in (frame, frame[["client_id", "updates"]]):
        out = plot_client_updates(f, tmp_path / f"updates{len(f.columns)}.png")
        assert out.read_bytes()[:8] == PNG_SIGNATURE and mpimg.imread(out).shape[2] in (3, 4)


def test_per_client_series_overlay_and_heatmap(tmp_path):
    """Issue 38: the per-client series as one overlaid plot and one heatmap (client_history.parquet)."""
    from rayfed_proto.tracking.clients import ClientHistory
    from rayfed_proto.tracking.plots import plot_client_heatmap, plot_client_series

    history = ClientHistory()
    for v in (0, 2, 4):
        history.add(v, [{"client_id": c, "n": 10, "head_correct": min(10, c * v), "proto_correct": None,
                         "train_loss": 1.0 / (v + 1)} for c in range(3)])
    frame = history.frame()
    assert len(frame) == 9 and "proto_acc" not in frame
    for fn in (plot_client_series, plot_client_heatmap):
        out = fn(frame, tmp_path / f"{fn.__name__}.png")
        assert out.read_bytes()[:8] == PNG_SIGNATURE
        empty = fn(ClientHistory().frame(), tmp_path / f"{fn.__name__}_empty.png")  # "no data", not an error
        assert empty.read_bytes()[:8] == PNG_SIGNATURE
