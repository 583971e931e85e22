#!/usr/bin/env python3
"""A run's TensorBoard event files, read with TensorBoard's own EventAccumulator, against its
metrics.jsonl.

    pip install tensorboard
    lora-train --recipe recipes/tiny-cpu.toml --set 'train.report_to=["tensorboard"]' \
        --set data.eval_fraction=0.1 --set train.eval_every=50
    python3 scripts/check_tensorboard.py adapters/tiny-cpu

EventAccumulator loads <run>/runs/ (every event file, CRCs checked by its record reader, a
SessionLog START purging what earlier files hold from its step on, as TensorBoard's server does).
Each number of each metrics.jsonl row must be there under the tag lora-train gives it (as
src/track/mod.rs `tag_of` names them: lr -> train/learning_rate, eval_<x> -> eval/<x>, a key
with a "/" as is, any other -> train/<key>, a nested object's keys -> <object>/<key>; bools as
0 / 1; nulls left out) at its step, equal to the value rounded to float32 (TensorBoard's
simple_value), and nothing else. Prints one line per tag and exits 1 on any difference.
"""
import json
import math
import struct
import sys
from pathlib import Path

CORE = ["train/loss", "train/learning_rate", "train/grad_norm"]


def tag_of(key):
    if key == "lr":
        return "train/learning_rate"
    if "/" in key:
        return key
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + key


def number(v):
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected(metrics_path):
    want = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        step = row["step"]
        for k, v in row.items():
            if k == "step":
                continue
            if isinstance(v, dict):
                items = [(f"{k}/{k2}", number(v2)) for k2, v2 in v.items()]
            else:
                items = [(tag_of(k), number(v))]
            for tag, x in items:
                if x is not None:
                    want.setdefault(tag, []).append((step, f32(x)))
    return want


def main():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = Path(sys.argv[1] if len(sys.argv) > 1 else "adapters/tiny-cpu")
    acc = EventAccumulator(str(run / "runs"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    want = expected(run / "metrics.jsonl")
    bad = 0
    for tag in sorted(set(got) | set(want)):
        g, w = got.get(tag, []), want.get(tag, [])
        same = len(g) == len(w) and all(a[0] == b[0] and (a[1] == b[1] or math.isnan(a[1]) and math.isnan(b[1])) for a, b in zip(g, w))
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} {tag}: {len(g)} values in the event files, {len(w)} in metrics.jsonl"
              + ("" if same else f"\n     events  {g}\n     metrics {w}"))
    for tag in CORE:
        if tag not in got:
            print(f"DIFF {tag}: not in the event files")
            bad += 1
    print(f"{run}: {len(got)} tags, {sum(map(len, got.values()))} values; "
          + ("event files equal metrics.jsonl" if not bad else f"{bad} tag(s) differ"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
