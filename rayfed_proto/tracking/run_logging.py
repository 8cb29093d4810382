"""Everything the driver logs to MLflow beyond the per-evaluation metrics, behind a few calls.

The driver creates one :class:`RunLogging` while it still holds the dataset (datasets, input
example), then calls :meth:`started`, :meth:`on_eval` per evaluation and :meth:`finish` at the end.
Keeping this here (not in runtime/) means the runtime only hands over what it has: the per-client
evaluation results, the final global state, the actor handles.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rayfed_proto.tracking import metric_names as names
from rayfed_proto.tracking.clients import ClientHistory, ClientSeries, client_table

log = logging.getLogger("rayfed_proto")

MAX_ACTORS_LOGGED = 64  # per-actor memory metrics; beyond that only the aggregates


class RunLogging:
    """What one run logs to MLflow beside the tracker's basics, and its evaluation ``history`` (one
    row per evaluation: the version and its metrics; a resumed run's starts with its checkpoint's)."""

    def __init__(self, cfg, tracker, dataset, partition, history: Optional[list[dict[str, Any]]] = None):
        from rayfed_proto.models import arch_for_client

        self.cfg, self.tracker = cfg, tracker
        self.history: list[dict[str, Any]] = list(history or [])
        n = cfg.federation.num_clients
        self.archs = [arch_for_client(cfg.model.group, c) for c in range(n)]
        self.class_names = list(dataset.class_names)
        self.dataset_name = str(getattr(dataset, "name", "") or cfg.data.name)  # npz/folder/hf: the file's or set's name
        self.train_counts = partition.label_counts("train")
        self.series = ClientSeries(n, cfg.tracking.client_series_limit, cfg.tracking.client_series_sample, cfg.seed)
        self.client_history = ClientHistory()  # every client at every evaluation: client_history.parquet, two plots
        self.partition = partition
        self.inputs: Optional[tuple[list, list]] = None
        self.input_example: Optional[np.ndarray] = None
        if cfg.tracking.enabled:
            from rayfed_proto.tracking.datasets import mlflow_datasets

            self.inputs = mlflow_datasets(dataset, partition, cfg)
            idx = next((c.test_idx for c in partition.clients if len(c.test_idx)), None)
            if idx is not None:
                self.input_example = dataset.tensors(np.asarray(idx[:2]))[0].numpy()

    # ------------------------------------------------------------------------------ start
    def new_run(self, out: Path, eval_clients: Optional[list[int]]) -> None:
        """A fresh run's first artifacts (its config, partition, label heatmap and the clients every
        evaluation covers, also written to ``out``), then :meth:`started`."""
        from rayfed_proto.tracking import plots  # here: it imports matplotlib, needed once per run

        cfg = self.cfg
        self.tracker.log_artifact(out / "config.yaml")
        self.tracker.log_artifact(out / "partition.parquet")
        heatmap = plots.plot_label_distribution(self.partition.label_counts(), out / "label_distribution.png",
                                                class_names=self.class_names,
                                                title=f"{cfg.data.name}: {cfg.data.partition.name} partition")
        self.tracker.log_artifact(heatmap, "plots")
        if eval_clients is not None:  # a sample of the clients
            (out / "eval_clients.txt").write_text("".join(f"{c}\n" for c in eval_clients))
            self.tracker.log_artifact(out / "eval_clients.txt")
        self.started()

    def started(self) -> None:
        """A fresh run: its name and identifying tags, the clients' test-split sizes (a param),
        datasets and the partition table."""
        if not self.cfg.tracking.enabled:
            return
        from rayfed_proto.tracking.clients import test_samples_param
        from rayfed_proto.tracking.datasets import partition_table

        try:
            self.tracker.set_tags(identity_tags(self.cfg, self.dataset_name, self.tracker.run_id))
            self.tracker.log_params({names.CLIENT_TEST_SAMPLES_PARAM: test_samples_param(
                [len(c.test_idx) for c in self.partition.clients])})
        except Exception as e:  # never fail a run for its bookkeeping
            log.warning("could not name the MLflow run: %r", e)

        try:
            if self.inputs is not None:
                datasets, contexts = self.inputs
                self.tracker.log_inputs(datasets, contexts, [{"rayfed_proto.split": d.name} for d in datasets])
        except Exception as e:  # never fail a run for its bookkeeping
            log.warning("could not log the datasets to MLflow: %r", e)
        try:
            self.tracker.log_table(partition_table(self.partition, self.class_names, self.archs), "tables/partition.json")
        except Exception as e:
            log.warning("could not log the partition table to MLflow: %r", e)

    # ------------------------------------------------------------------------------ evaluations
    def record_eval(self, version: int, metrics: dict[str, Any], counters: dict[str, float]) -> dict[str, Any]:
        """An evaluation's metrics without the per-client results (:meth:`on_eval`), with the run's
        ``counters`` as of it (reliability): added to the history and logged at ``version``; returned."""
        metrics = {**self.on_eval(version, dict(metrics)), **counters}
        self.history.append({"version": version, **metrics})
        self.tracker.log_metrics(metrics, step=version)
        return metrics

    def on_eval(self, version: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Takes the per-client results out of ``metrics`` (returned without them), keeps them for
        ``client_history.parquet`` and, with ``tracking.per_client_metrics``, logs the chosen
        clients' ``zz_client/<series>/client_<id>`` series at ``version``."""
        results = metrics.pop(names.PER_CLIENT, None)
        if results:
            self.client_history.add(version, results)
            series = self.series.metrics(version, results)
            if self.cfg.tracking.per_client_metrics:
                self.tracker.log_metrics(series, step=version)
        return metrics

    # ------------------------------------------------------------------------------ end
    def actor_memory(self, placements: list[dict[str, Any]], step: int) -> None:
        """Each actor's peak RSS and PSS at the end (the last placement is the server's): one row
        per actor in the table ``tables/actor_memory.json`` (a chart of one point per actor would
        only be a dot), and as metrics the clients' peak RSS and PSS (max, total) and the server's
        (:func:`run_end.actor_memory_metrics`): every memory figure of a run is logged here."""
        import pandas as pd

        from rayfed_proto.tracking.run_end import actor_memory_metrics  # pandas, as here

        rows = [{"actor": f"client_actor_{a}", **{f: p.get(f, float("nan")) for f in names.ACTOR_MEMORY}}
                for a, p in enumerate(placements[:-1][:MAX_ACTORS_LOGGED])]
        if placements:
            rows.append({"actor": "server", **{f: placements[-1].get(f, float("nan")) for f in names.ACTOR_MEMORY}})
            aggregates = actor_memory_metrics(placements) if len(placements) > 1 else {}
            self.tracker.log_metrics({**aggregates, names.SYSTEM_SERVER_PSS_MIB: placements[-1].get("pss_mib", float("nan"))},
                                     step=step)
            self.tracker.log_table(pd.DataFrame(rows), "tables/actor_memory.json")

    def collect_models(self, server, actors, actor_clients, state_ref,
                       updates: Optional[dict[int, int]] = None) -> list[dict[str, Any]]:
        """The models ``tracking.log_models`` chooses (``updates``: each client's local updates,
        for choosing a client that trained), fetched from the server and the worker actors (with
        each client's test accuracy), so that the actors can be released before :meth:`finish`
        logs them: the end of a run then holds no worker in memory. A model that cannot be
        fetched is skipped with a warning; it never fails a finished run."""
        import ray

        from rayfed_proto.tracking.models import choose_models

        choice = self.cfg.tracking.log_models
        if not self.cfg.tracking.enabled or choice == "none" or self.input_example is None or server is None:
            return []
        out: list[dict[str, Any]] = []
        try:
            server_model, server_metrics = ray.get(server.export_model.remote())
            accuracy = {c: row["head_acc"] for c, row in self.series.last.items() if "head_acc" in row}
            with_server, clients = choose_models(choice, server_model is not None, self.archs, updates, accuracy)
            if with_server:
                acc = {k: v for k, v in server_metrics.items() if k.startswith("global_acc")}
                out.append({"name": "server", "model": server_model, "metrics": acc, "split": "global_test",
                            "tags": {"rayfed_proto.model": "server", "algorithm": self.cfg.algorithm.name}})
            actor_of = {c: a for a, cs in enumerate(actor_clients) for c in cs}
            for c, why in clients.items():
                model, result = ray.get(actors[actor_of[c]].export_model.remote(c, state_ref))
                n = result["n"]
                acc = {}  # its test-split size is a tag: a constant makes a one-point chart (issue 38)
                if n:
                    acc["head_acc"] = result["head_correct"] / n
                    if result.get("proto_correct") is not None:
                        acc["proto_acc"] = result["proto_correct"] / n
                out.append({"name": f"client_{c}", "model": model, "metrics": acc, "split": "test", "why": why,
                            "tags": {"rayfed_proto.model": "client", "client_id": c, "architecture": self.archs[c],
                                     "test_samples": n,
                                     "algorithm": self.cfg.algorithm.name}})
        except Exception as e:  # a model that cannot be pickled must not fail a finished run
            log.warning("could not fetch the models to log to MLflow: %r", e)
        return out

    def finish(self, step: int, summary: str, models: Optional[list[dict[str, Any]]] = None,
               out: Optional[Path] = None) -> None:
        """End of a finished run: per-client history and plots (written to ``out``, the run
        folder), back-filled series, per-client table, the ``models`` from :meth:`collect_models`,
        description."""
        if out is not None:
            self._write_client_history(out)
        if not self.cfg.tracking.enabled:
            return
        described = self._log_client_series()
        try:
            self.tracker.log_table(client_table(self.series.last, self.train_counts, self.class_names, self.archs),
                                   "tables/clients.json")
        except Exception as e:
            log.warning("could not log the per-client table to MLflow: %r", e)
        logged = self._log_models(step, models or [])
        self.tracker.set_description(description(summary, described, logged))

    def _write_client_history(self, out: Path) -> None:
        """``client_history.parquet`` (one row per version and client) and its two plots, on disk
        and as artifacts: the per-client view that stays when the series are not metrics."""
        from rayfed_proto.tracking import plots

        try:
            frame = self.client_history.frame()
            frame.to_parquet(out / "client_history.parquet", index=False)
            self.tracker.log_artifact(out / "client_history.parquet")
            for fn, name in ((plots.plot_client_series, "client_head_acc.png"),
                             (plots.plot_client_heatmap, "client_head_acc_heatmap.png")):
                self.tracker.log_artifact(fn(frame, out / name), "plots")
        except Exception as e:  # never fail a finished run for its bookkeeping
            log.warning("could not write the per-client history: %r", e)

    def _log_client_series(self) -> str:
        """With ``tracking.per_client_metrics``: the back-filled series of a sample's extremes;
        returns (and tags) what the per-client series cover."""
        if not self.cfg.tracking.per_client_metrics:
            described = ("not logged as metrics (tracking.per_client_metrics: false); every client's series: "
                         "client_history.parquet, plots/client_head_acc.png, plots/client_head_acc_heatmap.png")
            self.tracker.set_tags({"rayfed_proto.client_series": described})
            return described
        points, described = self.series.backfill()
        self.tracker.set_tags({"rayfed_proto.client_series": described})
        try:
            self.tracker.log_metric_points(points)
        except Exception as e:
            log.warning("could not log the per-client series to MLflow: %r", e)
        return described

    def _log_models(self, step: int, models: list[dict[str, Any]]) -> list[str]:
        from rayfed_proto.tracking.models import log_pytorch_model

        logged: list[str] = []
        try:
            for m in models:
                log_pytorch_model(self.tracker, m["model"], m["name"], self.input_example, m["metrics"], step,
                                  split=self._split_name(m["split"]), tags=m["tags"], why=m.get("why"))
                shown = ", ".join(f"{k} {v:.4f}" for k, v in m["metrics"].items())
                logged.append(f"{m['name']} ({shown})" if shown else m["name"])
        except Exception as e:  # a model that cannot be saved must not fail a finished run
            log.warning("could not log models to MLflow: %r", e)
        return logged

    def _split_name(self, split: str) -> str:
        """The logged dataset's name of ``split`` (``digits/test``), as the run's Datasets panel shows it."""
        if self.inputs is None or not self.inputs[0]:
            return split
        return f"{getattr(self.inputs[0][0], 'name', '')}/{split}"


def description(summary: str, client_series: str, models: list[str]) -> str:
    """The run's description (markdown): the summary table, what the per-client series cover, the models."""
    lines = ["```", summary, "```", "",
             f"Per-client series (`{names.CLIENT_SECTION}/<series>/client_<id>` with `tracking.per_client_metrics: "
             f"true`; test-split sizes: the param `{names.CLIENT_TEST_SAMPLES_PARAM}`): {client_series}."]
    if models:
        lines.append(f"Logged models: {', '.join(models)} (load with `mlflow.pytorch.load_model('models:/<model id>')`).")
    lines.append("Charts: x = `Step` is the server version (aggregations). Counters (`reliability/`, dropped "
                 "updates) appear once non-zero. Metric names: `eval/`, `train/` (the clients' local updates: `train/loss`), `server/` (the server "
                 f"step: an algorithm's aggregate), `federation/`, `reliability/`, `system/`, `{names.CLIENT_SECTION}/` "
                 "(every name and the old names: docs/concepts.md, \"MLflow metric names\").")
    return "\n".join(lines)


def run_name(algorithm: str, dataset: str, seed: int, run_id: Optional[str]) -> str:
    """A run's default name (``tracking.run_name`` unset): what ran and a short id, so runs tell
    apart in the MLflow run list without extra columns: ``fedproto digits seed=0 3f2a1b``."""
    short = f" {run_id[:6]}" if run_id else ""
    return f"{algorithm} {dataset} seed={seed}{short}"[:250]


def identity_tags(cfg, dataset_name: str, run_id: Optional[str]) -> dict[str, str]:
    """Tags that say what a run is: ``dataset`` = the real set's name (an npz file's stem, the
    name in the Datasets panel; ``data.name`` is the loader: ``dataset.loader``), and, when
    ``tracking.run_name`` is unset, ``mlflow.runName`` = :func:`run_name` (instead of MLflow's
    random ``bright-mouse-390``)."""
    tags = {"dataset": dataset_name, "dataset.loader": cfg.data.name,
            "partition": f"{cfg.data.partition.name}"}
    if not cfg.tracking.run_name:
        tags["mlflow.runName"] = run_name(cfg.algorithm.name, dataset_name, cfg.seed, run_id)
    return tags
