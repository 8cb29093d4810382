import json, sys
n = same = 0
for part in ("hetero", "homo"):
    b = json.load(open(f"/tmp/cmp/before_{part}.json"))["rows"]
    a = json.load(open(f"/tmp/cmp/after_{part}.json"))["rows"]
    key = lambda r: (r["method"], r["dataset"], r["seed"])
    A = {key(r): r for r in a}
    for r in b:
        n += 1
        o = A[key(r)]
        fields = [k for k in r if k not in ("run_id", "seconds")]
        diff = [k for k in fields if r[k] != o.get(k) and not (r[k] != r[k] and o.get(k) != o.get(k))]
        if diff:
            print("DIFF", key(r), [(k, r[k], o.get(k)) for k in diff])
        else:
            same += 1
print(f"{same} of {n} rows equal in every field ({len(fields)} fields each: {', '.join(fields)})")
