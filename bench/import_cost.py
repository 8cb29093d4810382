"""What a torch process pays before it does any work, and what the lean runtime leaves out: private
memory of a fresh interpreter after each stage, against ``import torch`` alone measured in the
same run (each stage in its own interpreter, so nothing is shared between stages).

Private_Dirty (from /proc/self/smaps_rollup) is what every extra process pays again; shared
library pages are paid once however many processes map them, so they are reported apart
(Private_Clean in a lone process: these pages become shared as soon as a second process maps them).

    .venv/bin/python bench/import_cost.py --out bench/results/import_cost
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_MEASURE = r"""
import json, sys, collections
def rollup():
    d = {}
    for line in open('/proc/self/smaps_rollup'):
        p = line.split()
        if len(p) >= 3 and p[-1] == 'kB':
            d[p[0].rstrip(':')] = int(p[1]) / 1024
    return d
def dirty_by_mapping(top=4):
    agg, cur, last = collections.Counter(), None, 'start'
    for line in open('/proc/self/smaps'):
        p = line.split()
        if '-' in p[0] and not p[0].endswith(':'):
            name = p[5].split('/')[-1] if len(p) > 5 else None
            last, cur = (name, name) if name else (last, 'anonymous after ' + last)
        elif p[0] == 'Private_Dirty:':
            agg[cur] += int(p[1]) / 1024
    return [[k, round(v)] for k, v in agg.most_common(top)]
r = rollup()
print(json.dumps({"private_dirty_mib": round(r["Private_Dirty"]), "private_clean_mib": round(r["Private_Clean"]),
                  "dynamo": "torch._dynamo" in sys.modules, "triton": sys.modules.get("triton") is not None,
                  "top_dirty": dirty_by_mapping()}))
"""

_STEP = ("m = torch.nn.Linear(8, 2)\n"
         "opt = {opt}(m.parameters(), lr=0.1, momentum=0.9)\n"
         "m(torch.ones(4, 8)).sum().backward(); opt.step()\n")

STAGES = {
    "import torch (the reference)": "import torch\n",
    "+ a torch.optim.SGD step": "import torch\n" + _STEP.format(opt="torch.optim.SGD"),
    "+ a torch.optim.SGD step, Triton left out": "import sys; sys.modules['triton'] = None\nimport torch\n"
                                                 + _STEP.format(opt="torch.optim.SGD"),
    "+ a rayfed_proto.optim SGD step (the runtime on the CPU)": "import torch\nfrom rayfed_proto import optim\n"
                                                                + _STEP.format(opt="optim.sgd"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    import torch

    rows = []
    for name, code in STAGES.items():
        out = subprocess.run([sys.executable, "-c", code + _MEASURE], capture_output=True, text=True, check=True)
        rows.append({"stage": name, **json.loads(out.stdout.strip().splitlines()[-1])})
    ref = rows[0]["private_dirty_mib"]
    print(f"torch {torch.__version__}; private memory of one fresh interpreter (MiB)")
    print(f"{'stage':60s} {'dirty':>6s} {'vs torch':>9s} {'clean':>6s}  dynamo triton")
    for r in rows:
        r["dirty_over_torch_mib"] = r["private_dirty_mib"] - ref
        print(f"{r['stage']:60s} {r['private_dirty_mib']:6d} {r['dirty_over_torch_mib']:+9d} {r['private_clean_mib']:6d}"
              f"  {str(r['dynamo']):6s} {r['triton']}")
    print("largest private mappings after import torch:", rows[0]["top_dirty"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
