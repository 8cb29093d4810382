"""Fault drill: inject every failure the runtime claims to survive and report what was counted.

Each scenario is a real run (Ray actors, MLflow into a temporary folder) on the embedded digits,
4 clients, FedProto. Printed and saved: failures injected, whether the run finished, the
counters it logged (failures, restarts, updates lost or refused, versions redone), whether the
final global state is finite, and for the sync stop/resume scenario whether the final metrics
equal an uninterrupted run's.

    python bench/fault_drill.py                       # all scenarios
    python bench/fault_drill.py --out bench/results/fault_drill
    python bench/fault_drill.py --only guard:          # only the issue-16 guards (second table)

The guards (scenarios named ``guard: ...``) are runs that must *not* simply finish: no progress,
a damaged checkpoint, a finished or busy run folder, NaN pixels. Each reports what was expected
and what was observed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rayfed_proto.tracking import metric_names as names

BASE = ["algorithm.name=fedproto", "data.name=digits", "data.partition.beta=0.5", "data.partition.min_samples=20",
        "model.group=small_hetero", "model.feature_dim=32", "federation.num_clients=4", "federation.eval_every=1"]


def _named(part: str) -> str:
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors()]
    return sorted(n for n in names if n.startswith("rayfed:") and f":{part}:" in n)[-1]


def _kill_at(part: str, versions: set[int]):
    import ray

    done: list[int] = []

    def hook(version, metrics):
        if version in versions and version not in done:
            ray.kill(ray.get_actor(_named(part)), no_restart=True)
            done.append(version)

    return hook, done


def scenario_runs(tmp: Path, rounds: int):
    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.signals import RunInterrupted

    def cfg(name, extra):
        return build_config({}, BASE + [f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                        f"tracking.output_dir={tmp / name}", f"federation.rounds={rounds}", *extra])

    quiet = {"progress": False, "echo": lambda s: None}

    hook, done = _kill_at("client:0", {2})
    yield "client actor killed once (async)", 1, lambda: run_experiment(
        cfg("kill_client", ["federation.mode=async", "federation.buffer_size=1", "federation.concurrency=2",
                            "checkpoint.every=2"]), on_eval=hook, **quiet), done
    hook, done = _kill_at("client:0", {1, 2, 3})
    yield "client 0 killed 3 times, limit 1 (sync)", 3, lambda: run_experiment(
        cfg("kill_repeat", ["federation.mode=sync", "reliability.max_client_failures=1", "checkpoint.every=0"]),
        on_eval=hook, **quiet), done
    hook, done = _kill_at("server", {3})
    yield "server actor killed once (sync, checkpoint every 2)", 1, lambda: run_experiment(
        cfg("kill_server", ["federation.mode=sync", "checkpoint.every=2"]), on_eval=hook, **quiet), done
    hook, done = _kill_at("server", {3})
    yield "server actor killed once (async, checkpoint every 2)", 1, lambda: run_experiment(
        cfg("kill_server_async", ["federation.mode=async", "federation.buffer_size=1", "federation.concurrency=2",
                                  "checkpoint.every=2"]), on_eval=hook, **quiet), done
    for kind in ("nan", "inf", "shape", "unknown_class", "future_version"):
        yield f"client 1 uploads garbage: {kind} (sync)", rounds, lambda kind=kind: run_experiment(
            cfg(f"garbage_{kind}", ["federation.mode=sync", "checkpoint.every=0", "faults.corrupt_clients=[1]",
                                    f"faults.corrupt_kind={kind}"]), **quiet), None

    def stopped_and_resumed(name: str, common: list[str]):
        """The uninterrupted run, and the same run stopped at the middle version and resumed."""
        straight = run_experiment(cfg(f"{name}_straight", common), **quiet)
        try:
            run_experiment(cfg(f"{name}_stopped", common + [f"faults.stop_at_version={rounds // 2 + 1}"]), **quiet)
            raise AssertionError("the stop did not happen")
        except RunInterrupted as stop:
            resumed = run_experiment(cfg(f"{name}_stopped", common), resume_dir=stop.output_dir, **quiet)
        return straight, resumed

    def figures(history):  # accuracies, losses and means (staleness included) per evaluated version
        return {h["version"]: {k: None if v != v else v for k, v in h.items()  # NaN (nothing yet) as None
                               if k.endswith(("_acc", "loss", "_mean"))} for h in history}

    def stop_and_resume():
        straight, resumed = stopped_and_resumed(
            "sync", ["federation.mode=sync", "checkpoint.every=2", "federation.participation=0.5"])
        a, b = straight.history[-1], resumed.history[-1]
        keys = [k for k in a if k.endswith(("_acc", "loss", "_mean")) and not k.startswith("federation/")]
        differ = [k for k in keys if a[k] != b.get(k)]
        if differ:
            print(f"resumed run differs from the uninterrupted one in {differ}", flush=True)
        resumed.exact = not differ
        return resumed

    yield "interrupt + resume (sync) vs uninterrupted", 1, stop_and_resume, None

    def stop_async_between_evaluations():
        # issue 45: a stop at a version that is not evaluated (eval_every 3), resumed; on the
        # virtual clock the resumed run must equal the uninterrupted one at every evaluated version
        straight, resumed = stopped_and_resumed("async", [
            "federation.mode=async", "federation.buffer_size=1", "federation.concurrency=2", "federation.eval_every=3",
            "checkpoint.every=2", "system={speed: {kind: lognormal, sigma: 1.0}}"])
        a, b = figures(straight.history), figures(resumed.history)
        differ = sorted(v for v in a.keys() | b.keys() if a.get(v) != b.get(v))
        if differ:
            print(f"resumed async run differs from the uninterrupted one at versions {differ}", flush=True)
        resumed.exact = not differ
        return resumed

    yield "interrupt between evaluations + resume (async, virtual clock) vs uninterrupted", 1, \
        stop_async_between_evaluations, None


def guard_scenarios(tmp: Path, rounds: int):
    """(name, expected, run) where run() returns what was observed, as text."""
    from mlflow.tracking import MlflowClient

    from rayfed_proto.config import InputError, build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.preparation import checkpoint_store
    from rayfed_proto.runtime.progress import NoProgressError
    from rayfed_proto.runtime.runfolder import RunFolderLock
    from rayfed_proto.runtime.signals import RunInterrupted

    uri = f"sqlite:///{tmp / 'mlflow.db'}"

    def cfg(name, extra):
        return build_config({}, BASE + [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp / name}",
                                        f"federation.rounds={rounds}", *extra])

    quiet = {"progress": False, "echo": lambda s: None}

    def no_progress():
        try:
            run_experiment(cfg("all_garbage", ["federation.mode=async", "federation.buffer_size=2", "checkpoint.every=0",
                                               "faults.corrupt_clients=[0,1,2,3]", "reliability.max_consecutive_refusals=8"]),
                           **quiet)
            return "finished (WRONG)"
        except NoProgressError as e:
            client = MlflowClient(uri)
            exp = client.get_experiment_by_name("rayfed_proto")
            run = [r for r in client.search_runs([exp.experiment_id]) if "failure_reason" in r.data.tags][-1]
            return (f"NoProgressError; MLflow {run.info.status}, updates_refused={run.data.metrics.get(names.FEDERATION_UPDATES_REFUSED):g}: "
                    f"{str(e)[:60]}...")

    yield "guard: every client uploads garbage (async)", "stops, MLflow FAILED, refusals logged", no_progress

    def empty_sync():
        result = run_experiment(cfg("all_garbage_sync", ["federation.mode=sync", "checkpoint.every=0",
                                                         "faults.corrupt_clients=[0,1,2,3]"]), **quiet)
        return f"finished; versions_empty={result.history[-1][names.FEDERATION_VERSIONS_EMPTY]} of {result.final_version}"

    yield "guard: every update refused (sync)", "counted and warned per version", empty_sync

    def damaged_then_finished():
        common = ["federation.mode=sync", "checkpoint.every=1", "checkpoint.keep=2"]
        try:
            run_experiment(cfg("damaged", common + [f"faults.stop_at_version={rounds // 2}"]), **quiet)
        except RunInterrupted as stop:
            out = stop.output_dir
        newest = checkpoint_store(cfg("damaged", common), out).latest()
        data = (newest.path / "server.pt").read_bytes()
        (newest.path / "server.pt").write_bytes(data[: len(data) // 2])
        said: list[str] = []
        result = run_experiment(cfg("damaged", common), resume_dir=out, progress=False, echo=said.append)
        observed = next(s for s in said if s.startswith("resuming from")).split("(")[-1].rstrip(")")
        held = RunFolderLock(out).acquire()
        try:
            run_experiment(cfg("damaged", common), resume_dir=out, **quiet)
            busy = "second driver ran (WRONG)"
        except InputError as e:
            busy = "second driver refused" if "in use by another driver" in str(e) else f"refused: {e}"
        finally:
            held.release()
        try:
            run_experiment(cfg("damaged", common), resume_dir=out, **quiet)
            again = "rerun (WRONG)"
        except InputError as e:
            again = "refused (finished)" if "already finished" in str(e) else f"refused: {e}"
        more = run_experiment(cfg("damaged", [*common, f"federation.rounds={rounds + 1}"]), resume_dir=out, **quiet)
        return (f"newest v{newest.version} damaged: resumed from {observed}, finished v{result.final_version}; {busy}; "
                f"resume of finished: {again}; rounds+1: finished v{more.final_version}")

    yield "guard: damaged newest checkpoint, then busy / finished folder", \
        "older checkpoint used; second driver and rerun refused; extension continues", damaged_then_finished

    def final_checkpoint_lost():  # issue 25, item 1
        common = ["federation.mode=sync", "checkpoint.every=1", "checkpoint.keep=2"]
        done = run_experiment(cfg("final_lost", common), **quiet)
        final = checkpoint_store(cfg("final_lost", common), done.output_dir).latest()
        data = (final.path / "server.pt").read_bytes()
        (final.path / "server.pt").write_bytes(data[: len(data) // 2])
        said: list[str] = []
        more = run_experiment(cfg("final_lost", [*common, f"federation.rounds={rounds + 2}"]),
                              resume_dir=done.output_dir, progress=False, echo=said.append)
        observed = next(s for s in said if s.startswith("resuming from")).split("(")[-1].rstrip(")")
        tags = MlflowClient(uri).get_run(more.run_id).data.tags
        return (f"final v{final.version} damaged: extended from {observed}, finished v{more.final_version}; "
                f"superseded_steps={tags.get('superseded_steps')}; MLflow {MlflowClient(uri).get_run(more.run_id).info.status}")

    yield "guard: finished run whose final checkpoint is damaged, extended", \
        "continues from the older checkpoint, redoes the versions after it (tagged superseded)", final_checkpoint_lost

    def killed_driver_other_folder():  # issue 25, item 2
        import os
        import signal
        import subprocess

        import ray

        sets = [x for o in BASE + [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp / 'killed'}",
                                   "federation.mode=sync", "federation.rounds=40", "checkpoint.every=1",
                                   f"resources.address={ray.get_runtime_context().gcs_address}"] for x in ("--set", o)]
        proc = subprocess.Popen([sys.executable, "-m", "rayfed_proto.cli", "run", "--no-progress", *sets],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
        deadline = time.monotonic() + 300
        while not list((tmp / "killed").glob("*/checkpoints/v000001/manifest.json")):
            if proc.poll() is not None or time.monotonic() > deadline:
                return "the driver to kill never reached its first checkpoint (ERROR)"
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        out = next((tmp / "killed").iterdir())
        run_id = json.loads((out / "run.json").read_text())["run_id"]
        before = MlflowClient(uri).get_run(run_id).info.status
        said: list[str] = []
        run_experiment(cfg("elsewhere", ["federation.mode=sync", "checkpoint.every=0", "federation.rounds=1"]),
                       progress=False, echo=said.append)
        after = MlflowClient(uri).get_run(run_id)
        ok = after.info.status == "KILLED" and after.data.tags.get("resume_from") == str(out)
        return (f"after SIGKILL: {before}; a new run in another folder: {after.info.status}, resume_from "
                f"{'set' if ok else 'MISSING (WRONG)'}; told: {'yes' if any(run_id in s for s in said) else 'no (WRONG)'}")

    yield "guard: driver SIGKILLed, next run uses another folder", \
        "the dead driver's run settled (KILLED, resume_from) and the new run says so", killed_driver_other_folder

    def windows_end_early():  # issue 25, item 3
        windows = tmp / "online.csv"
        windows.write_text("client_id,start_s,end_s\n" + "".join(f"{c},0,1e-9\n" for c in range(4)))
        virtual = ["federation.mode=async", "federation.buffer_size=2", "federation.concurrency=2", "checkpoint.every=0",
                   "system.availability.kind=csv", f"system.availability.path={windows}"]
        try:
            run_experiment(cfg("windows_short", virtual), **quiet)
            short = "ran (WRONG)"
        except InputError as e:
            short = "refused before Ray (exit 2)" if "system.availability" in str(e) else f"refused: {e}"
        try:  # 4 clients x 1 start each pass the bound for 2 versions; only 2 run at once, so 1 version forms
            run_experiment(cfg("windows_dry", [*virtual, "federation.rounds=2"]), **quiet)
            dry = "finished (WRONG)"
        except NoProgressError as e:
            client = MlflowClient(uri)
            run = [r for r in client.search_runs([client.get_experiment_by_name("rayfed_proto").experiment_id])
                   if "no client can be online" in r.data.tags.get("failure_reason", "")][-1]
            import pandas as pd

            kept = list(pd.read_parquet(next((tmp / "windows_dry").iterdir()) / "history.parquet")["version"])
            dry = f"exit 1, MLflow {run.info.status} with failure_reason, history versions {kept}: {str(e)[:40]}..."
        return f"{rounds} rounds: {short}; 2 rounds: {dry}"

    yield "guard: availability windows end before the run", \
        "too short for any run: refused before Ray; running dry: FAILED with reason, history kept", windows_end_early

    def tracking_under_load():  # issue 25, item 8; reduced: bench/tracking_load.py runs 8 trials + 2 runs
        from tracking_load import build_parser, run_load  # bench/, this script's folder

        r = run_load(build_parser().parse_args(["--trials", "2", "--plain", "2", "--rounds", "3", "--plain-rounds", "8",
                                                "--hold-s", "45"]), "sqlite", tmp / "tracking_load", echo=lambda s: None)
        shown = r["lock_lines"] + r["operational_error_lines"]
        wrong = shown or r["finished"] < r["runs_expected"] or r["missing"] or r["runs_without_history"]
        return (f"{r['finished']}/{r['runs_expected']} runs FINISHED; metric points {r['points']}/{r['expected_points']} "
                f"(missing {r['missing']}); {r['calls_during_lock']} tracker calls met the lock, {r['retries']} retried; "
                f"lock errors shown: {shown}; exit codes {sorted(r['exit_codes'].values())}" + (" (WRONG)" if wrong else ""))

    yield "guard: tracking under load (2-trial sweep + 2 runs, one sqlite store locked 45 s)", \
        "every run FINISHED with every version's metrics; no lock error reaches the user", tracking_under_load

    def nan_pixels():
        images = np.random.default_rng(0).random((60, 8, 8)).astype(np.float32)
        images[11, 1, 1] = np.nan
        path = tmp / "nan.npz"
        np.savez(path, images=images, labels=np.arange(60) % 3)
        try:
            run_experiment(cfg("nan", ["data.name=npz", f"data.path={path}"]), **quiet)
            return "ran (WRONG)"
        except InputError as e:
            return str(e).split(": ", 1)[1][:70]

    yield "guard: .npz images with NaN", "refused before the run (exit 2)", nan_pixels
    yield from issue40_guards(tmp, cfg, uri)


def _cli(args: list[str], cwd: Path, **popen):
    import os
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "rayfed_proto.cli", *args], cwd=cwd, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, **popen)


def _sigterm_while_actors_start(tmp: Path, uri: str) -> str:
    """The CLI with its own Ray, SIGTERM when the actors start (-v logs each start-up stage)."""
    import signal

    from mlflow.tracking import MlflowClient

    from rayfed_proto.runtime.signals import signal_cli_at_stage

    sets = [x for o in BASE + [f"tracking.tracking_uri={uri}", f"tracking.output_dir={tmp / 'sigterm'}",
                               "federation.rounds=3", "tracking.system_metrics=false"] for x in ("--set", o)]
    done = signal_cli_at_stage(["run", "--no-progress", *sets], "actors starting", signal.SIGTERM, tmp)
    client = MlflowClient(uri)
    runs = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
            if r.data.tags.get("rayfed_proto.output_dir", "").startswith(str(tmp / "sigterm"))]
    status = ", ".join(f"{r.info.status} ({r.data.tags.get('failure_reason', '')[:50]}...)" for r in runs) or "none"
    traceback = "Traceback" in done.output or "Exception ignored" in done.output
    wrong = done.returncode != 143 or done.alive or traceback or not done.sent
    return (f"exit {done.returncode}; MLflow {status}; processes left: {len(done.alive)}; traceback: "
            f"{'yes' if traceback else 'no'}" + (" (WRONG)" if wrong else ""))


def issue40_guards(tmp: Path, cfg, uri: str):
    """Issue 40's cases: signals during start-up, a crafted or damaged resume, the last unchecked
    inputs, faults that ended with a traceback or the wrong exit code."""
    import errno
    import hashlib
    import pickle

    from mlflow.tracking import MlflowClient

    from rayfed_proto.config import ConfigError, InputError, build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.preparation import checkpoint_store
    from rayfed_proto.runtime.runfolder import RunFault
    from rayfed_proto.runtime.signals import RunInterrupted
    from rayfed_proto.tracking import run_end

    quiet = {"progress": False, "echo": lambda s: None}
    yield "guard: SIGTERM while the actors start (issue 40)", \
        "exit 143, MLflow FAILED with the reason, no process left, no traceback", lambda: _sigterm_while_actors_start(tmp, uri)

    def crafted_resume():
        common = ["federation.mode=sync", "checkpoint.every=1"]
        try:
            run_experiment(cfg("crafted", common + ["faults.stop_at_version=2"]), **quiet)
        except RunInterrupted as stop:
            out = stop.output_dir
        ckpt = checkpoint_store(cfg("crafted", common), out).latest()
        data = pickle.dumps({"model": "a raw pickle"})
        (ckpt.path / "clients" / "0.pt").write_bytes(data)
        manifest = json.loads((ckpt.path / "manifest.json").read_text())
        manifest["files"]["clients/0.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (ckpt.path / "manifest.json").write_text(json.dumps(manifest))
        run_id = ckpt.manifest["run_id"]
        try:
            run_experiment(cfg("crafted", common), resume_dir=out, **quiet)
            crafted = "resumed (WRONG)"
        except InputError as e:
            crafted = f"refused before Ray (exit 2): {str(e)[:70]}..."
        status = MlflowClient(uri).get_run(run_id).info.status
        import shutil

        shutil.rmtree(ckpt.path)  # the crafted version deleted, as the message says: the older one is intact
        (out / "partition.parquet").write_bytes(b"PAR1 damaged")
        try:
            run_experiment(cfg("crafted", common), resume_dir=out, **quiet)
            part = "resumed (WRONG)"
        except InputError as e:
            part = "refused (exit 2), file named" if str(out / "partition.parquet") in str(e) else f"refused: {e} (WRONG)"
        return (f"raw-pickle clients/0.pt: {crafted} MLflow stays {status}"
                + ("" if status == "KILLED" else " (WRONG)") + f"; damaged partition.parquet: {part}")

    yield "guard: resume of a stopped run with a raw-pickle client state, then a damaged partition (issue 40)", \
        "refused before Ray and MLflow (exit 2), run stays KILLED; partition named", crafted_resume

    def inputs():
        refused = []
        for key, value in (("training.lr", float("inf")), ("federation.num_clients", True), ("seed", 2**65),
                           ("tracking.tracking_uri", "foo://bar"), ("resources.park_dir", "/etc/hostname")):
            try:
                c = build_config({}, BASE + [f"{key}={value}", f"tracking.output_dir={tmp / 'inputs'}",
                                             "resources.park_to=disk"])
                if key == "tracking.tracking_uri":
                    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker

                    MlflowTracker(c.tracking)
                else:
                    from rayfed_proto.runtime.parking import check_park_dir

                    check_park_dir(c.resources.park_dir)
                refused.append(f"{key} accepted (WRONG)")
            except (ConfigError, InputError, PermissionError) as e:
                refused.append(key if key in str(e) else f"{key} (key not named: WRONG)")
        import subprocess

        pipe = _cli(["list"], tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pipe.stdout.close()  # the reader goes away, as head's does
        err = pipe.stderr.read()
        pipe.wait()
        return (f"refused naming the key: {', '.join(refused)}; list into a closed pipe: exit {pipe.returncode}, "
                f"stderr {'empty' if not err else 'WITH TEXT (WRONG)'}")

    yield "guard: inf, a bool, a 2**65 seed, foo:// tracking, a file as park_dir, list into a closed pipe (issue 40)", \
        "each refused before Ray naming the key (exit 2); list quietly", inputs

    def disk_faults():
        said = []
        for name, error in (("full", OSError(errno.ENOSPC, "No space left on device")),
                            ("unwritable", PermissionError(errno.EACCES, "Permission denied"))):
            original = run_end.write_final_artifacts

            def failing(out, *args, error=error, **kwargs):
                error.filename = str(out / "history.parquet")
                raise error

            run_end.write_final_artifacts = failing
            try:
                run_experiment(cfg(f"disk_{name}", ["federation.mode=sync", "checkpoint.every=1"]), **quiet)
                said.append(f"{name}: finished (WRONG)")
            except RunFault as e:
                client = MlflowClient(uri)
                run = [r for r in client.search_runs([e_.experiment_id for e_ in client.search_experiments()])
                       if r.data.tags.get("failure_reason") == str(e)]
                said.append(f"{name}: exit 1, MLflow {run[0].info.status if run else 'NOT FAILED (WRONG)'}, "
                            f"kept: {'checkpoint named' if 'checkpoint of version' in str(e) else 'none'}")
            finally:
                run_end.write_final_artifacts = original
        return "; ".join(said)

    yield "guard: disk full / run folder unwritable at the end of a run, simulated (issue 40)", \
        "exit 1 (never 2), MLflow FAILED with failure_reason naming the folder and the kept checkpoint", disk_faults


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench/results/fault_drill")
    parser.add_argument("--only", default="", help="run only scenarios whose name contains this text")
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    rows, guards = [], []
    with tempfile.TemporaryDirectory() as d:
        for name, expected, run in guard_scenarios(Path(d), args.rounds):
            if args.only not in name:
                continue
            t0 = time.perf_counter()
            try:
                observed = run()
            except Exception as e:  # a drill reports a failure instead of stopping the others
                observed = f"ERROR {e!r}"[:300]
            guards.append({"scenario": name, "expected": expected, "observed": observed,
                           "wall_s": round(time.perf_counter() - t0, 1)})
            print(json.dumps(guards[-1]), flush=True)
        for name, injected, run, done in scenario_runs(Path(d), args.rounds):
            if args.only not in name:
                continue
            t0 = time.perf_counter()
            try:
                result = run()
                last = result.history[-1]
                bank = result.output_dir / "global_prototypes.npz"
                row = {"scenario": name, "injected": len(done) if done is not None else injected,
                       "finished": result.final_version == args.rounds,
                       "client_failures": last[names.RELIABILITY_CLIENT_FAILURES],
                       "clients_excluded": last[names.RELIABILITY_CLIENTS_EXCLUDED],
                       "server_restarts": last[names.RELIABILITY_SERVER_RESTARTS],
                       "updates_lost": last[names.RELIABILITY_UPDATES_LOST_CLIENT] + last[names.RELIABILITY_UPDATES_LOST_SERVER],
                       "versions_redone": last[names.RELIABILITY_VERSIONS_REDONE],
                       "updates_refused": last[names.FEDERATION_UPDATES_REFUSED],
                       "global_state_finite": bool(np.isfinite(np.load(bank)["vectors"]).all()) if bank.exists() else None,
                       "exact_resume": getattr(result, "exact", None), "wall_s": round(time.perf_counter() - t0, 1)}
            except Exception as e:  # a drill reports a failure instead of stopping the others
                row = {"scenario": name, "injected": injected, "finished": False, "error": repr(e)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"runs": rows, "guards": guards}, indent=1))
    cols = ["scenario", "injected", "finished", "client_failures", "clients_excluded", "server_restarts", "updates_lost",
            "versions_redone", "updates_refused", "global_state_finite", "exact_resume"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    if guards:
        lines += ["", "| guard | expected | observed |", "|---|---|---|"]
        lines += [f"| {g['scenario'][7:]} | {g['expected']} | {g['observed']} |" for g in guards]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r.get("finished") for r in rows) and not any("WRONG" in g["observed"] or "ERROR" in g["observed"]
                                                                 for g in guards) else 1


if __name__ == "__main__":
    sys.exit(main())
