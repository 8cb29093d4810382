"""Fault drill: inject every failure the runtime claims to survive and report what was counted.

Each scenario is a real run (Ray actors, MLflow into a temporary folder) on the embedded digits,
4 clients, FedProto. Printed and saved: failures injected, whether the run finished, the
counters it logged (failures, restarts, updates lost or refused, versions redone), whether the
final global state is finite, and for the sync stop/resume scenario whether the final metrics
equal an uninterrupted run's.

    python bench/fault_drill.py                       # all scenarios
    python bench/fault_drill.py --out bench/results/fault_drill
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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
    from rayfed_proto.runtime.driver import RunInterrupted, run_experiment

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

    def stop_and_resume():
        common = ["federation.mode=sync", "checkpoint.every=2", "federation.participation=0.5"]
        straight = run_experiment(cfg("straight", common), **quiet)
        try:
            run_experiment(cfg("stopped", common + [f"faults.stop_at_version={rounds // 2 + 1}"]), **quiet)
            raise AssertionError("the stop did not happen")
        except RunInterrupted as stop:
            resumed = run_experiment(cfg("stopped", common), resume_dir=stop.output_dir, **quiet)
        a, b = straight.history[-1], resumed.history[-1]
        keys = [k for k in a if k.endswith(("_acc", "_loss", "_mean")) and not k.startswith(("staleness", "wall"))]
        differ = [k for k in keys if a[k] != b.get(k)]
        if differ:
            print(f"resumed run differs from the uninterrupted one in {differ}", flush=True)
        resumed.exact = not differ
        return resumed

    yield "interrupt + resume (sync) vs uninterrupted", 1, stop_and_resume, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench/results/fault_drill")
    parser.add_argument("--only", default="", help="run only scenarios whose name contains this text")
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as d:
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
                       "client_failures": last["client_failures"], "clients_excluded": last["clients_excluded"],
                       "server_restarts": last["server_restarts"],
                       "updates_lost": last["updates_lost_client"] + last["updates_lost_server"],
                       "versions_redone": last["versions_redone"], "updates_refused": last["updates_refused"],
                       "global_state_finite": bool(np.isfinite(np.load(bank)["vectors"]).all()) if bank.exists() else None,
                       "exact_resume": getattr(result, "exact", None), "wall_s": round(time.perf_counter() - t0, 1)}
            except Exception as e:  # a drill reports a failure instead of stopping the others
                row = {"scenario": name, "injected": injected, "finished": False, "error": repr(e)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    cols = ["scenario", "injected", "finished", "client_failures", "clients_excluded", "server_restarts", "updates_lost",
            "versions_redone", "updates_refused", "global_state_finite", "exact_resume"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r.get("finished") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
