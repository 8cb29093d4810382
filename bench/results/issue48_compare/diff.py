"""Compare the before/after method-comparison rows field by field (run ids and seconds aside)."""

import json
from pathlib import Path

HERE = Path(__file__).parent


def key(r):
    return r["method"], r["dataset"], r["seed"]


n = same = 0
for part in ("hetero", "homo"):
    before = json.loads((HERE / f"before_{part}.json").read_text())["rows"]
    after = {key(r): r for r in json.loads((HERE / f"after_{part}.json").read_text())["rows"]}
    for r in before:
        n += 1
        o = after[key(r)]
        fields = [k for k in r if k not in ("run_id", "seconds")]
        diff = [k for k in fields if r[k] != o.get(k) and not (r[k] != r[k] and o.get(k) != o.get(k))]
        if diff:
            print("DIFF", key(r), [(k, r[k], o.get(k)) for k in diff])
        else:
            same += 1
print(f"{same} of {n} rows equal in every field")
