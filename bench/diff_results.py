"""Which figures moved between two result files of the same benchmark, and by how much: the mean
over seeds of each metric per group, old and new side by side (a Markdown table).

    .venv/bin/python bench/diff_results.py bench/results/compare_methods.json \\
        bench/results/compare_methods_issue23.json --group dataset method \\
        --metrics final_head best_head final_proto best_proto

Rows are matched on the ``--group`` columns; a group present in one file only is listed with
a dash on the other side. Values in [0, 1] are shown as percentages.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def load(path: Path, group: list[str]) -> dict[tuple, list[dict]]:
    rows = json.loads(path.read_text())["rows"]
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(g) for g in group), []).append(r)
    return out


def mean(rows: list[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None and not math.isnan(float(r[key]))]
    return statistics.fmean(values) if values else math.nan


def fmt(v: float, pct: bool) -> str:
    return "-" if math.isnan(v) else (f"{100 * v:.1f}" if pct else f"{v:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--group", nargs="+", required=True)
    ap.add_argument("--metrics", nargs="+", required=True)
    args = ap.parse_args()
    old, new = load(args.old, args.group), load(args.new, args.group)
    print("| " + " | ".join(args.group + [f"{m} old -> new (seeds)" for m in args.metrics]) + " |")
    print("|" + "---|" * (len(args.group) + len(args.metrics)))
    for key in sorted(set(old) | set(new), key=str):
        cells = [str(k) for k in key]
        for m in args.metrics:
            a, b = mean(old.get(key, []), m), mean(new.get(key, []), m)
            pct = all(0 <= v <= 1 for v in (a, b) if not math.isnan(v))
            delta = "" if math.isnan(a) or math.isnan(b) else f" ({'+' if b >= a else ''}{fmt(b - a, pct)})"
            cells.append(f"{fmt(a, pct)} -> {fmt(b, pct)}{delta} ({len(old.get(key, []))}/{len(new.get(key, []))})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
