#!/usr/bin/env python3
"""The table of scripts/device/ab_builds.sh: for each row, build A's and build B's bench tok/s
(median of the rounds) and peak GiB, B / A; and the `train` command's tok/s over its steps past
warm-up (metrics.jsonl) beside its build's 7B bench.

  python3 scripts/device/ab_table.py OUT_DIR
"""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for line in (out / "ab.jsonl").read_text().splitlines() if (out / "ab.jsonl").exists() else []:
    r = json.loads(line)
    build, row = r["tag"].split(":")
    runs.setdefault((row, build), []).append(r)


def med(rs, key):
    return statistics.median(r[key] for r in rs)


print(f"{'row':6} {'A tok/s':>10} {'B tok/s':>10} {'B/A':>7} {'A GiB':>7} {'B GiB':>7}  runs")
for row in ["7b", "8b", "moe"]:
    a, b = runs.get((row, "a")), runs.get((row, "b"))
    if not a or not b:
        continue
    ta, tb = med(a, "tokens_per_s"), med(b, "tokens_per_s")
    print(
        f"{row:6} {ta:>10.1f} {tb:>10.1f} {tb / ta:>7.4f} {med(a, 'peak_alloc_gib'):>7.2f} "
        f"{med(b, 'peak_alloc_gib'):>7.2f}  A {[round(r['tokens_per_s']) for r in a]} "
        f"B {[round(r['tokens_per_s']) for r in b]}"
    )
for build in ["a", "b"]:
    p = out / f"train-{build}.jsonl"
    if not p.exists():
        continue
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    if len(rows) < 8:
        continue
    x, y = rows[5], rows[-2]  # steps 7 .. last but one (see device_gpu_check.sh train7b)
    tps = (y["tokens"] - x["tokens"]) / (y["elapsed_s"] - x["elapsed_s"])
    bench = runs.get(("7b", build))
    ratio = f"{tps / med(bench, 'tokens_per_s'):.4f} of its bench" if bench else ""
    print(f"train {build.upper()}: steps {x['step'] + 1}-{y['step']}: {tps:.1f} tok/s {ratio}; "
          f"load_s {rows[0].get('load_s')}")
