#!/usr/bin/env python3
"""A large Alpaca jsonl for the data-at-scale check (issue 69): rows synthesized from
recipes/data/tiny-alpaca.jsonl with varied text, seeded, so that every run makes the same file.

    python3 scripts/make_big_alpaca.py --mb 160 --out /tmp/big-alpaca.jsonl

Each row keeps the shape of a tiny-alpaca row (instruction, optional input, output) and mixes
in sentences built from the words of the whole file, with lengths from a few words to a few
hundred, so that rows are of every size (about 1 KB on average) and tokenize to varied lengths.
The file is not committed (it is large); this script is.
"""

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=160.0, help="size of the file in MB (1e6 bytes)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=69)
    a = ap.parse_args()
    rows = [json.loads(l) for l in (ROOT / "recipes/data/tiny-alpaca.jsonl").read_text().splitlines() if l.strip()]
    words = sorted({w for r in rows for k in ("instruction", "input", "output") for w in r[k].split()})
    rng = random.Random(a.seed)

    def sentence(lo, hi):
        n = rng.randint(lo, hi)
        s = " ".join(rng.choice(words) for _ in range(n))
        return s[:1].upper() + s[1:].rstrip(".?!,") + rng.choice([".", ".", ".", "?", "!"])

    def text(k_lo, k_hi, lo, hi):
        return " ".join(sentence(lo, hi) for _ in range(rng.randint(k_lo, k_hi)))

    target = int(a.mb * 1e6)
    size = 0
    n = 0
    with open(a.out, "w", encoding="utf-8") as f:
        while size < target:
            base = rng.choice(rows)
            kind = rng.random()
            instruction = base["instruction"]
            if kind < 0.5:
                instruction = f"{instruction} {text(1, 3, 4, 14)}"
            inp = base["input"]
            if rng.random() < 0.4:
                inp = text(1, 6, 5, 20)
            out = base["output"]
            # Mostly short answers, some long ones (past seq_len once tokenized).
            if kind < 0.85:
                out = f"{out} {text(1, 8, 5, 18)}"
            else:
                out = f"{out} {text(10, 40, 8, 25)}"
            line = json.dumps({"instruction": instruction, "input": inp, "output": out}, ensure_ascii=False)
            f.write(line + "\n")
            size += len(line.encode()) + 1
            n += 1
    print(f"wrote {n} rows, {size / 1e6:.1f} MB to {a.out}")


if __name__ == "__main__":
    main()
