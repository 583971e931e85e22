#!/usr/bin/env python3
"""The sweep's table (scripts/sweep.sh) from its JSON lines: one row per tag, ours against the
plain row (tag "plain") and against what the row's FLOPs predict, and the peers beside it.

  python3 scripts/sweep_table.py /tmp/out/sweep.jsonl [--plain plain] [--cliff 0.9]

Columns: our tok/s; vs plain (tok/s over plain's); predicted (plain's work_flops_per_token over
the row's: the ratio the row would reach at plain's FLOP rate); efficiency (vs plain over
predicted; below --cliff, 0.9, the row is marked a cliff); our peak GiB; PEFT's and PEFT +
Liger's tok/s and ours over each. A tag run more than once keeps its last line. Below the
table, each row that saves checkpoints: its writes' seconds against save_every of plain's
steps (whether the writer keeps up). Standard library only.
"""
import argparse
import json
import sys

OURS = "lora-train"
PEERS = [("PEFT", "transformers+peft"), ("PEFT+Liger", "transformers+peft+liger")]


def load(path):
    runs = {}
    order = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            tag = d.get("tag")
            if tag is None:
                continue
            if tag not in runs:
                runs[tag] = {}
                order.append(tag)
            runs[tag][d.get("system")] = d
    return order, runs


def tps(d):
    if d is None:
        return None
    if d.get("oom"):
        return "OOM"
    return d.get("tokens_per_s")


def fmt(x, spec="{:,.0f}"):
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    return spec.format(x)


def table(order, runs, plain_tag="plain", cliff=0.9):
    plain = runs.get(plain_tag, {}).get(OURS)
    if plain is None:
        return f"no `{plain_tag}` row of ours: nothing to compare against\n"
    p_tps, p_work = plain["tokens_per_s"], plain.get("work_flops_per_token")
    head = ["row", "ours tok/s", "vs plain", "predicted", "efficiency", "peak GiB"]
    for name, _ in PEERS:
        head += [f"{name} tok/s", f"ours / {name}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cliffs = []
    for tag in order:
        r = runs[tag]
        ours = r.get(OURS)
        t = tps(ours)
        cells = [tag, fmt(t)]
        if isinstance(t, (int, float)):
            rel = t / p_tps
            work = ours.get("work_flops_per_token")
            pred = p_work / work if p_work and work else None
            eff = rel / pred if pred else None
            mark = " **cliff**" if eff is not None and eff < cliff else ""
            if mark:
                cliffs.append((tag, eff))
            cells += [fmt(rel, "{:.3f}"), fmt(pred, "{:.3f}"), fmt(eff, "{:.3f}") + mark,
                      fmt(ours.get("peak_alloc_gib"), "{:.1f}")]
        else:
            cells += ["—"] * 4
        for _, system in PEERS:
            pt = tps(r.get(system))
            cells.append(fmt(pt))
            ok = isinstance(t, (int, float)) and isinstance(pt, (int, float)) and pt > 0
            cells.append(fmt(t / pt, "{:.2f}×") if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if cliffs:
        out += "\ncliffs (efficiency below %.2f): %s\n" % (
            cliff, ", ".join(f"{t} {e:.3f}" for t, e in cliffs))
    else:
        out += "\nno cliff: every row within %.0f%% of its FLOPs' prediction\n" % ((1 - cliff) * 100)
    return out + saves(order, runs, plain)


def saves(order, runs, plain):
    """For each row that saves checkpoints: whether the writer keeps up. A save whose write
    takes longer than save_every of plain's steps makes the next save wait for it: the row is
    then bound by the write (the disk), not by its FLOPs."""
    out = []
    for tag in order:
        d = runs[tag].get(OURS)
        every = (d or {}).get("save_every") or 0
        writes = (d or {}).get("save_write_s") or []
        if every <= 0 or not writes:
            continue
        write = sum(writes) / len(writes)
        interval = every * plain["step_s"]
        mb = 12 * d.get("trainable_params", 0) / 1e6  # adapter, AdamW's m and v: f32
        n_saves = len(writes)
        verdict = ("the writer keeps up" if write <= interval else
                   "the writer does not keep up: the next save waits (bound by the write)")
        out.append(f"{tag}: {n_saves} checkpoints of ~{mb:,.0f} MB, each written in {write:.3f} s "
                   f"({mb / write:,.0f} MB/s) against {every} steps of plain = {interval:.3f} s: "
                   f"{verdict}; the loop spent {d.get('save_start_s', 0):.3f} s starting them and "
                   f"{d.get('save_final_wait_s', 0):.3f} s waiting for the last")
    return "".join("\n" + l + "\n" for l in out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl")
    p.add_argument("--plain", default="plain", help="the tag every row is compared against")
    p.add_argument("--cliff", type=float, default=0.9, help="efficiency below which a row is a cliff")
    a = p.parse_args()
    order, runs = load(a.jsonl)
    sys.stdout.write(table(order, runs, a.plain, a.cliff))


if __name__ == "__main__":
    main()
