#!/usr/bin/env python3
"""Where a step's GPU time goes: an `ncu --csv --metrics gpu__time_duration.sum` log summed
by kernel and by kind of work, as a markdown table.

    ncu --csv --clock-control none --launch-skip K --launch-count N \
        --metrics gpu__time_duration.sum lora-train bench ... > kernels.csv
    python3 scripts/kernel_table.py kernels.csv [--steps S] [--top 20]

The window is cut to whole steps: from the first launch after one optimizer update
(`--step-end`, a regex of the kernel that ends a step; adamw_multi) to the last update, and
the ms are per step. Without two updates in the window the ms are the window's.
scripts/device_gpu_check.sh `profile` runs it.
"""
import argparse
import collections
import csv
import io
import re
import sys

# Kind of work by kernel name, first match wins (ours: src/ops/*.cu; cuBLAS / cuBLASLt GEMMs;
# candle's elementwise kernels).
KINDS = [
    ("GEMM (cuBLAS)", r"gemm|xmma|cutlass|nvjet|cublas|splitk|sm90_|sm80_"),
    ("adapters' fold / sums", r"lora|sum_parts|drop_xas|acc_block|row_dot"),
    ("attention", r"flash|^fl_|attn|masked_lse|masked_exp|softmax"),
    ("soft-cap / cross-entropy", r"softcap|cross_entropy"),
    ("GLU (SwiGLU / GeGLU)", r"swiglu|geglu"),
    ("RMSNorm", r"rms_norm"),
    ("RoPE / layout", r"rope|relayout"),
    ("optimizer, clip, casts", r"adamw|sumsq|clip_step|cast_multi|cast_rows"),
    ("MoE routing", r"moe|expert|topk|sort|scatter|gather|index"),
    ("dropout", r"dropout"),
    ("elementwise, copies", r"add_|copy|cast|affine|fill|unary|binary|bmul|badd|bsub|bdiv|where|reduce|sum|max|min|exp|neg|sqr|conv"),
]
UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
           "second": 1e9, "s": 1e9}


def kind(name):
    for k, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return k
    return "other"


def rows(text):
    """(kernel name, ns) of each profiled launch in ncu's CSV (lines before the header skipped)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit("kernel_table: no ncu CSV header (\"ID\",...) in the input")
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNIT_NS.get(r.get("Metric Unit", "nsecond"))
        if unit is None:
            sys.exit(f"kernel_table: unknown unit {r.get('Metric Unit')!r}")
        value = float(r["Metric Value"].replace(",", ""))
        yield r["Kernel Name"], value * unit


def whole_steps(launches, step_end):
    """The launches of the whole steps in the window and their count: those after the first
    run of `step_end` launches through the last such run (a step ends with its update)."""
    ends = [i for i, (name, _) in enumerate(launches) if re.search(step_end, short(name))]
    runs = [i for j, i in enumerate(ends) if j + 1 == len(ends) or ends[j + 1] != i + 1]
    if len(runs) < 2:
        return launches, 0
    return launches[runs[0] + 1 : runs[-1] + 1], len(runs) - 1


def short(name, width=70):
    name = re.sub(r"\(.*", "", name)  # drop the argument list of demangled names
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--step-end", default=r"^adamw_multi")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    launches = list(rows(open(a.csv, errors="replace").read()))
    if not launches:
        sys.exit("kernel_table: no gpu__time_duration.sum rows")
    window, steps = whole_steps(launches, a.step_end)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, ns in window:
        by_name[name][0] += ns
        by_name[name][1] += 1
    total = sum(ns for ns, _ in by_name.values())
    per = steps if steps > 0 else 1.0
    unit = "ms a step" if steps > 0 else "ms in the window"
    print(f"{len(window)} launches, {total / 1e6:.1f} ms of kernels"
          + (f" over {steps} whole steps: {len(window) / steps:.0f} launches and {total / 1e6 / steps:.1f} ms a step"
             if steps else " (not two optimizer updates in the window: not cut to steps)"))
    print()
    by_kind = collections.defaultdict(float)
    for name, (ns, _) in by_name.items():
        by_kind[kind(name)] += ns
    print(f"| kind | {unit} | share |")
    print("|---|---|---|")
    for k, ns in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {ns / 1e6 / per:.1f} | {100 * ns / total:.1f}% |")
    print()
    print(f"| kernel | kind | launches | {unit} | share |")
    print("|---|---|---|---|---|")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]
    for name, (ns, n) in top:
        print(f"| `{short(name)}` | {kind(name)} | {n / per:g} | {ns / 1e6 / per:.2f} | {100 * ns / total:.1f}% |")


if __name__ == "__main__":
    main()
