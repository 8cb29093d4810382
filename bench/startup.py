"""Time to the first update of `make demo`'s experiment, as a new user meets it: `rayfed-proto run`
in a fresh folder (a new MLflow database each time), repeated; the figure is the run's own
``startup_s`` metric (process start to the first local update returned), the "startup" row of its
summary. Issue 11's target is absolute (15 s), so there is no reference loop; the spread across
repeats is the point, since the first run after heavy work on the box is slower.

    .venv/bin/python bench/startup.py --repeats 4 --out bench/results/startup
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(Path(sys.executable).parent / "rayfed-proto"), "run", "--no-progress",
               "--set", "federation.rounds=10"] + [a for s in extra for a in ("--set", s)]
        out = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"run failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{Path(d) / 'mlflow.db'}")
        exp = client.get_experiment_by_name("rayfed_proto_demo")
        data = client.search_runs([exp.experiment_id])[0].data  # a tag since issue 49 (a metric before)
        return float(data.tags.get("federation/startup_s", data.metrics.get("federation/startup_s", "nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for the run")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    times = []
    for i in range(args.repeats):
        times.append(round(one_run(args.set), 1))
        print(f"run {i + 1}: first update after {times[-1]} s", flush=True)
    row = {"runs_s": times, "median_s": statistics.median(times), "under_15_s": sum(t <= 15 for t in times)}
    print(f"median {row['median_s']} s; {row['under_15_s']} of {len(times)} runs within the 15 s target")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "row": row}, indent=1))


if __name__ == "__main__":
    main()
