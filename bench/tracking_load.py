"""Tracking under load: a sweep of concurrent trials and plain runs at once, writing one MLflow store.

Two stores, one after the other, the same load on each:

- ``sqlite``: the default store, a ``sqlite:///`` file. The sweep serves it with its own local
  ``mlflow server`` (what ``rayfed-proto tune`` does over a sqlite store), and the plain runs write
  the same file directly (what ``rayfed-proto run`` does): several processes write one file.
- ``server``: one ``mlflow server`` (:class:`rayfed_proto.tuning.mlflow_server.LocalMlflowServer`)
  started by this script; the sweep and the plain runs all log to it over HTTP.

The load: ``rayfed-proto tune`` with ``--trials`` trials (a grid over ``algorithm.lam``), all
allowed at once (``max_concurrent_trials``), each a tiny run (digits, ``--clients`` clients, one
client actor, ``--rounds`` sync rounds, an evaluation every version, 0.05 CPU per bundle), and
``--plain`` ``rayfed-proto run`` processes (``--plain-rounds`` rounds) started when the first trial
has logged a version. Tracking settings are the defaults (system metrics on, models logged).

Measured, per store:

- every run's MLflow status, and for every run and core metric (``eval/head_acc``,
  ``eval/head_acc_mean``, ``eval/proto_acc``, ``train/loss``) the versions in MLflow
  (``MlflowClient.get_metric_history``) against the versions in the run's own
  ``history.parquet`` (missing and duplicated steps counted);
- the lines of the processes' output (the tune process receives its trials' output) that
  mention ``database is locked``, ``OperationalError`` or a ``Traceback``, and the exit codes;
- the time each run spent in the tracker's ``log_metrics`` (timed in every process, trial
  workers included, by a ``sitecustomize`` hook this script puts on ``PYTHONPATH``), per logged
  version, and the run's wall time per version between its first and last logged version.
  The ratio ``on/off`` is, for the same run, wall per version / (wall per version - tracking per
  version): the run against itself without the time its tracker spent;
- how many runs were logging at once (writers at each logged version: median and max).

    python bench/tracking_load.py                                  # 8 trials + 2 runs, sqlite then server
    python bench/tracking_load.py --stores sqlite --trials 4 --out /tmp/tl
    python bench/tracking_load.py --stores sqlite --trials 2 --hold-s 45   # and the store locked for 45 s

``--hold-s`` adds a fault: once the plain runs are logging, another process takes the sqlite
file's write lock and keeps it that long (a backup, ``mlflow gc``, a long query over a big store).
MLflow waits 20 s for a lock (its ``PRAGMA busy_timeout``), then raises ``database is locked``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

CORE = ("eval/head_acc", "eval/head_acc_mean", "eval/proto_acc", "train/loss")
PATTERNS = {"database is locked": re.compile(r"database is locked", re.I),
            "OperationalError": re.compile(r"OperationalError"),
            "Traceback": re.compile(r"^\s*(\(\w+.*\)\s*)?Traceback \(most recent call last\)", re.M)}
EXPERIMENT = "tracking_load"

# Put on PYTHONPATH of every process of the load (Ray passes the environment on to its workers):
# times MlflowTracker.log_metrics / start / end when rayfed_proto.tracking.mlflow_tracker is
# imported, one JSON line per call in $RAYFED_TRACKING_LOAD_DIR/<pid>.jsonl.
HOOK = r'''
import os, sys
_DIR = os.environ.get("RAYFED_TRACKING_LOAD_DIR")
if _DIR:
    import importlib.abc, importlib.util, json, time
    _TARGET = "rayfed_proto.tracking.mlflow_tracker"

    def _patch(mod):
        cls = mod.MlflowTracker

        def wrap(name):
            orig = getattr(cls, name)

            def timed(self, *a, **k):
                t0, w0, err = time.perf_counter(), time.time(), None
                try:
                    return orig(self, *a, **k)
                except BaseException as e:
                    err = repr(e)[:300]
                    raise
                finally:
                    rec = {"pid": os.getpid(), "call": name, "run_id": getattr(self, "run_id", None),
                           "step": k.get("step", a[1] if name == "log_metrics" and len(a) > 1 else None),
                           "t0": w0, "s": time.perf_counter() - t0, "error": err,
                           "retries": getattr(self, "retries", None)}
                    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps(rec) + "\n")

            setattr(cls, name, timed)

        for n in ("start", "resume", "log_metrics", "end"):
            wrap(n)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
'''


def base_config(args, tmp: Path, uri: str) -> dict[str, Any]:
    return {"data": {"name": "digits", "partition": {"name": "dirichlet", "beta": 0.5, "min_samples": 20}},
            "model": {"group": "small_hetero", "feature_dim": 32},
            "algorithm": {"name": "fedproto"},
            "federation": {"mode": "sync", "num_clients": args.clients, "rounds": args.rounds, "eval_every": 1},
            "checkpoint": {"every": 0},
            "resources": {"num_cpus": args.cpus},
            "tracking": {"experiment_name": EXPERIMENT, "tracking_uri": uri, "output_dir": str(tmp / "runs")}}


def sweep_file(args, tmp: Path, uri: str) -> Path:
    import yaml

    raw = {"name": "load", "base": base_config(args, tmp, uri),
           "search_space": {"algorithm.lam": {"grid": [round(0.1 * (i + 1), 2) for i in range(args.trials)]}},
           "num_samples": 1, "metric": "eval/head_acc", "mode": "max", "scheduler": {"name": "fifo"},
           "max_concurrent_trials": args.trials, "max_failures": 0,
           "trial_resources": {"driver_cpus": 0.05, "server_cpus": 0.05, "client_cpus": 0.05, "client_actors": 1},
           "storage_path": str(tmp / "tune")}
    path = tmp / "load_sweep.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def plain_command(args, tmp: Path, uri: str, i: int) -> list[str]:
    sets = ["data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20", "algorithm.name=fedproto",
            "model.group=small_hetero", "model.feature_dim=32", "federation.mode=sync",
            f"federation.num_clients={args.clients}", f"federation.rounds={args.plain_rounds}", "federation.eval_every=1",
            "checkpoint.every=0", f"resources.num_cpus={args.cpus}", f"tracking.experiment_name={EXPERIMENT}",
            f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp / 'runs' / f'plain{i}'}",
            f"tracking.run_name=plain-{i}"]
    return [sys.executable, "-m", "rayfed_proto.cli", "run", "--no-progress", *[x for s in sets for x in ("--set", s)]]


def _records(timings: Path) -> list[dict[str, Any]]:
    out = []
    for f in timings.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


HOLD = ("import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=120)\n"
        "c.execute('BEGIN EXCLUSIVE')\n"
        "print('held', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "c.execute('COMMIT')\n")


def _plain_logging(timings: Path, procs: dict[str, subprocess.Popen]) -> bool:
    """Every plain run has logged a version after version 0 (it is in its loop)."""
    pids = {p.pid for n, p in procs.items() if n.startswith("plain")}
    logged = {r["pid"] for r in _records(timings) if r["call"] == "log_metrics" and (r["step"] or 0) >= 1}
    return bool(pids) and pids <= logged


def _first_trial_logged(timings: Path, plain_pids: set[int]) -> bool:
    return any(r["call"] == "log_metrics" and r["pid"] not in plain_pids for r in _records(timings))


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_load(args, store: str, tmp: Path, echo=print) -> dict[str, Any]:
    """One store under the whole load; returns the counts (see the module doc)."""
    from rayfed_proto.tuning.mlflow_server import LocalMlflowServer

    db_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    timings = tmp / "timings"
    timings.mkdir(parents=True, exist_ok=True)
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "RAYFED_TRACKING_LOAD_DIR": str(timings),
           "PYTHONPATH": os.pathsep.join([str(hook), str(Path(__file__).resolve().parents[1]),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("MLFLOW_TRACKING_URI", None)
    server = None
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    started = time.monotonic()
    try:
        uri = db_uri
        if store == "server":
            server = LocalMlflowServer(db_uri, log_path=tmp / "mlflow-server.log")
            uri = server.start()
            echo(f"[{store}] MLflow server {uri} over {db_uri}")
        sweep = sweep_file(args, tmp, uri)

        def launch(name: str, cmd: list[str]) -> None:
            logs[name] = tmp / f"{name}.log"
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)

        launch("tune", [sys.executable, "-m", "rayfed_proto.cli", "tune", str(sweep), "--quiet"])
        echo(f"[{store}] sweep of {args.trials} trials started ({args.trials} at once)")
        deadline = started + args.timeout_s
        plain_at = None
        hold: Optional[subprocess.Popen] = None
        held: dict[str, float] = {}
        while time.monotonic() < deadline:
            if plain_at is None and (_first_trial_logged(timings, set()) or procs["tune"].poll() is not None
                                     or time.monotonic() - started > args.plain_after_s):
                for i in range(args.plain):
                    launch(f"plain{i}", plain_command(args, tmp, uri, i))
                plain_at = time.monotonic() - started
                echo(f"[{store}] {args.plain} plain runs started at {plain_at:.0f} s")
            if args.hold_s > 0 and hold is None and plain_at is not None and _plain_logging(timings, procs):
                # another process takes the sqlite file's write lock and keeps it (what a backup,
                # `mlflow gc` or a long query over a big store does): longer than MLflow's 20 s wait
                hold = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp / "mlflow.db"), str(args.hold_s)],
                                        stdout=subprocess.PIPE, text=True)
                hold.stdout.readline()
                held["t0"] = time.time()
                echo(f"[{store}] store locked by another process for {args.hold_s:g} s at {time.monotonic() - started:.0f} s")
            if hold is not None and "t1" not in held and hold.poll() is not None:
                held["t1"] = time.time()
            if plain_at is not None and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(1)
        if hold is not None:
            hold.wait()
            held.setdefault("t1", time.time())
        timed_out = [n for n, p in procs.items() if p.poll() is None]
        for p in procs.values():
            _stop(p)
        wall = time.monotonic() - started
        echo(f"[{store}] load done in {wall:.0f} s" + (f"; killed at the timeout: {timed_out}" if timed_out else ""))
        records = _records(timings)
        result = count(db_uri, records, logs, {n: p.returncode for n, p in procs.items()}, args)
        result.update({"store": store + (f" + locked {args.hold_s:g} s" if args.hold_s > 0 else ""),
                       "wall_s": round(wall, 1), "timed_out": timed_out,
                       "plain_started_s": None if plain_at is None else round(plain_at, 1),
                       "hold_s": args.hold_s if held else 0,
                       # tracker calls that were running while the store was locked: the lock hit writers
                       "calls_during_lock": sum(1 for x in records if held and x["t0"] < held["t1"]
                                                and x["t0"] + x["s"] > held["t0"])})
        return result
    finally:
        for p in procs.values():
            _stop(p)
        if server is not None:
            server.stop()


def _history_versions(output_dir: Optional[str]) -> Optional[dict[str, list[int]]]:
    """Per core metric, the versions at which the run's own history.parquet has a finite value."""
    import math

    import pandas as pd

    if not output_dir or not (Path(output_dir) / "history.parquet").is_file():
        return None
    frame = pd.read_parquet(Path(output_dir) / "history.parquet")
    out = {}
    for key in CORE:
        if key in frame:
            out[key] = sorted(int(v) for v, x in zip(frame["version"], frame[key], strict=True)
                              if isinstance(x, (int, float)) and math.isfinite(x))
    return out


def count(db_uri: str, records: list[dict[str, Any]], logs: dict[str, Path], codes: dict[str, Optional[int]],
          args) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from rayfed_proto.runtime.runfolder import OUTPUT_DIR

    client = MlflowClient(db_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], max_results=1000) if exp is not None else []
    parents = {r.data.tags.get("mlflow.parentRunId") for r in runs} - {None}
    per_run = []
    for r in runs:
        if r.info.run_id in parents:  # the sweep's parent run: no versions of its own
            continue
        expected = _history_versions(r.data.tags.get(OUTPUT_DIR))
        row = {"run": (r.info.run_name or "")[:40], "run_id": r.info.run_id, "status": r.info.status,
               "kind": "trial" if "mlflow.parentRunId" in r.data.tags else "plain", "versions": 0,
               "expected_points": 0, "points": 0, "missing": 0, "duplicated": 0, "history": expected is not None}
        for key in CORE:
            steps = [m.step for m in client.get_metric_history(r.info.run_id, key)]
            want = set((expected or {}).get(key, []))
            row["points"] += len(steps)
            row["expected_points"] += len(want)
            row["missing"] += len(want - set(steps))
            row["duplicated"] += len(steps) - len(set(steps))
            if key == CORE[0]:
                row["versions"] = len(set(steps))
        calls = [x for x in records if x["run_id"] == r.info.run_id and x["call"] == "log_metrics"]
        if calls:
            s = [x["s"] for x in calls]
            n = max(1, row["versions"])
            span = max(x["t0"] + x["s"] for x in calls) - min(x["t0"] for x in calls)
            per_version = span / max(1, n - 1)
            tracking = sum(s) / n
            row.update({"log_calls": len(calls), "log_errors": sum(x["error"] is not None for x in calls),
                        "retries": max((x.get("retries") or 0) for x in calls),
                        "tracking_s_per_version": tracking, "log_call_s_max": max(s),
                        "wall_s_per_version": per_version,
                        "ratio_on_off": per_version / (per_version - tracking) if per_version > tracking else None})
        per_run.append(row)
    # writers at once: at each log_metrics call, the runs between their first and last call
    spans = {}
    for x in records:
        if x["call"] == "log_metrics" and x["run_id"]:
            a, b = spans.get(x["run_id"], (x["t0"], x["t0"]))
            spans[x["run_id"]] = (min(a, x["t0"]), max(b, x["t0"] + x["s"]))
    at_once = [sum(a <= x["t0"] <= b for a, b in spans.values()) for x in records if x["call"] == "log_metrics"]
    found = {}
    for name, path in logs.items():
        text = path.read_text(errors="replace") if path.exists() else ""
        found[name] = {k: len(p.findall(text)) for k, p in PATTERNS.items()}
        examples = [line.strip()[:240] for line in text.splitlines() if PATTERNS["database is locked"].search(line)
                    or PATTERNS["OperationalError"].search(line)]
        if examples:
            found[name]["examples"] = examples[:5]
    trial_errors = sorted(str(p) for p in (Path(next(iter(logs.values()))).parent / "tune").rglob("error.txt"))
    # a trial Ray's memory monitor killed (a shared machine short of memory) fails for a reason of its own
    oom = [p for p in trial_errors if re.search(r"OutOfMemoryError|out of memory", Path(p).read_text(errors="replace"), re.I)]
    kinds = [r["kind"] for r in per_run]
    timed = [r for r in per_run if r.get("tracking_s_per_version") is not None]
    return {
        "runs": len(per_run), "runs_expected": args.trials + args.plain,
        "trials": kinds.count("trial"), "plain": kinds.count("plain"),
        "finished": sum(r["status"] == "FINISHED" for r in per_run),
        "statuses": {s: sum(r["status"] == s for r in per_run) for s in sorted({r["status"] for r in per_run})},
        "points": sum(r["points"] for r in per_run), "expected_points": sum(r["expected_points"] for r in per_run),
        "missing": sum(r["missing"] for r in per_run), "duplicated": sum(r["duplicated"] for r in per_run),
        "runs_without_history": sum(not r["history"] for r in per_run),
        "lock_lines": sum(v["database is locked"] for v in found.values()),
        "operational_error_lines": sum(v["OperationalError"] for v in found.values()),
        "tracebacks": sum(v["Traceback"] for v in found.values()),
        "exit_codes": codes, "trial_error_files": trial_errors, "trials_killed_oom": len(oom), "output": found,
        "log_errors": sum(r.get("log_errors", 0) for r in per_run), "retries": sum(r.get("retries", 0) for r in per_run),
        "tracking_ms_per_version": 1000 * statistics.median([r["tracking_s_per_version"] for r in timed]) if timed else None,
        "tracking_ms_per_version_max": 1000 * max(r["tracking_s_per_version"] for r in timed) if timed else None,
        "log_call_ms_max": 1000 * max(r["log_call_s_max"] for r in timed) if timed else None,
        "wall_s_per_version": statistics.median([r["wall_s_per_version"] for r in timed]) if timed else None,
        "ratio_on_off": statistics.median([r["ratio_on_off"] for r in timed if r["ratio_on_off"]]) if timed else None,
        "writers_at_once_median": statistics.median(at_once) if at_once else 0,
        "writers_at_once_max": max(at_once) if at_once else 0,
        "per_run": per_run,
    }


COLUMNS = [("store", "store"), ("runs FINISHED", None), ("points / expected", None), ("missing", "missing"),
           ("duplicated", "duplicated"), ("lock lines in output", "lock_lines"), ("OperationalError lines", "operational_error_lines"),
           ("tracebacks", "tracebacks"), ("writers at once (median / max)", None),
           ("tracking ms per version (median / max run)", None), ("slowest log call ms", None),
           ("wall s per version", None), ("on/off", None), ("store locked s / tracker calls meanwhile", None),
           ("wall s", "wall_s")]


def _cell(r: dict[str, Any], title: str, key: Optional[str]) -> str:
    def f(x, d=0):
        return "" if x is None else f"{x:.{d}f}"

    if key:
        return str(r.get(key))
    oom = f"; {r['trials_killed_oom']} trials killed by Ray's OOM killer" if r.get("trials_killed_oom") else ""
    return {"runs FINISHED": f"{r['finished']} / {r['runs']} (of {r['runs_expected']}){oom}",
            "points / expected": f"{r['points']} / {r['expected_points']}",
            "writers at once (median / max)": f"{r['writers_at_once_median']:g} / {r['writers_at_once_max']}",
            "tracking ms per version (median / max run)": f"{f(r['tracking_ms_per_version'])} / {f(r['tracking_ms_per_version_max'])}",
            "slowest log call ms": f(r["log_call_ms_max"]),
            "wall s per version": f(r["wall_s_per_version"], 2),
            "on/off": f(r["ratio_on_off"], 3),
            "store locked s / tracker calls meanwhile": f"{r.get('hold_s', 0):g} / {r.get('calls_during_lock', 0)}"}[title]


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(t for t, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, t, k) for t, k in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", default="sqlite,server", help="comma-separated: sqlite, server")
    p.add_argument("--trials", type=int, default=8, help="trials of the sweep, all at once")
    p.add_argument("--plain", type=int, default=2, help="plain rayfed-proto run processes beside the sweep")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="versions of each trial")
    p.add_argument("--plain-rounds", type=int, default=12, help="versions of each plain run")
    p.add_argument("--cpus", type=int, default=2, help="CPUs each local Ray instance declares")
    p.add_argument("--plain-after-s", type=float, default=600.0,
                   help="start the plain runs after this long if no trial has logged a version yet")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="per store: processes still running are killed")
    p.add_argument("--hold-s", type=float, default=0.0,
                   help="once the plain runs are logging, another process holds the sqlite file's lock this long "
                        "(0: never; MLflow waits 20 s for a lock, then raises 'database is locked')")
    p.add_argument("--keep", help="keep each store's folder under this folder (default: a temporary one)")
    p.add_argument("--out", default="bench/results/tracking_load", help="write OUT.json and OUT.md")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    results = []
    for store in [s.strip() for s in args.stores.split(",") if s.strip()]:
        if store not in ("sqlite", "server"):
            p.error(f"--stores: sqlite or server, not {store!r}")
        if args.keep:
            tmp = Path(args.keep).resolve() / store
            tmp.mkdir(parents=True, exist_ok=True)
            results.append(run_load(args, store, tmp))
        else:
            with tempfile.TemporaryDirectory(prefix=f"tracking-load-{store}-") as d:
                results.append(run_load(args, store, Path(d)))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k not in ("per_run", "output")}), flush=True)
    text = table(results)
    print(text)
    for r in results:
        ratio = "n/a" if r["ratio_on_off"] is None else f"{r['ratio_on_off']:.3f}"
        print(f"{r['store']}: tracking on/off per version (the same run without its tracker's time) = {ratio}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/tracking_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "args": vars(args), "results": results}, indent=1))
        out.with_suffix(".md").write_text(f"`{meta['command']}` ({meta['date']}, {meta['cpus']} CPUs, load average "
                                          f"{meta['load_average'][0]:.1f})\n\n{text}\n")
    ok = all(r["finished"] == r["runs"] == r["runs_expected"] and r["missing"] == 0 and r["lock_lines"] == 0
             and r["operational_error_lines"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
