"""FedTGP aggregation_scope latest vs buffer on the demo (preset `default`: async, 20 clients, K = 2, 100
versions), seeds 0-2 (issue 15 item 5). Writes rows (head/proto accuracy per evaluation) to /tmp/wt15demo/rows.json;
the committed copy is bench/results/demo_fedtgp_scope.json.

    PYTHONPATH=. python bench/demo_fedtgp_scope.py
"""
import json
import math
import os
import time

import ray

from rayfed_proto.cli import resolve_config_arg
from rayfed_proto.config import load_config
from rayfed_proto.runtime.driver import run_experiment
from rayfed_proto.tracking import metric_names as names

os.makedirs("/tmp/wt15demo", exist_ok=True)
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
rows = []
for seed in (0, 1, 2):
    for scope in ("latest", "buffer"):
        t0 = time.perf_counter()
        cfg = load_config(resolve_config_arg("default"), [f"seed={seed}", f"algorithm.aggregation_scope={scope}",
              "tracking.tracking_uri=sqlite:////tmp/wt15demo/mlflow.db", "tracking.output_dir=/tmp/wt15demo/runs",
              f"tracking.run_name=demo-{scope}-s{seed}"])
        res = run_experiment(cfg, progress=False, echo=lambda s: None)
        h = res.history
        head = [x.get(names.EVAL_HEAD_ACC, math.nan) for x in h]
        proto = [x.get(names.EVAL_PROTO_ACC, math.nan) for x in h]
        row = {"seed": seed, "scope": scope, "seconds": time.perf_counter() - t0,
               "versions": [x["version"] for x in h], "head": head, "proto": proto,
               "rolled_back": h[-1].get(names.SERVER_VERSIONS_ROLLED_BACK)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("versions",)}), flush=True)
        json.dump(rows, open("/tmp/wt15demo/rows.json", "w"))
ray.shutdown()
