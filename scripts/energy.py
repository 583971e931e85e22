#!/usr/bin/env python3
"""The GPU energy of a bench's timed steps, read from the driver while it runs.

    python3 scripts/energy.py [--gpu 0] [--json F] [--tag T] --runs R -- COMMAND ...

COMMAND is `lora-train bench ... --json R` or `scripts/bench_peft.py ... --json R`: both append
a JSON line with `timed_unix_s`, the wall-clock window of their timed steps, to R. Meanwhile this
script reads GPU `--gpu`'s energy counter (NVML, millijoules since the driver loaded) every 10 ms,
or without pynvml integrates nvidia-smi's instantaneous power sampled every 50 ms; afterwards it
prints (and appends to F) one JSON line: the joules within the window, a step's joules and
milliseconds, the mean watts, the tokens per kilojoule, and the run's tok/s.

On a GPU held at its power limit a step's time follows its energy, so tokens per joule is the
figure that kernel work must move (BENCHMARKS.md, "Where the time goes").
"""
import argparse
import json
import shutil
import subprocess
import sys
import threading
import time


class Counter(threading.Thread):
    """(unix time, joules since the driver loaded) every 10 ms from NVML."""

    def __init__(self, gpu):
        super().__init__(daemon=True)
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        self.read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3
        self.read()  # raises on a GPU without the counter
        self.rows, self.on, self.source = [], True, "nvml energy counter"

    def run(self):
        while self.on:
            self.rows.append((time.time(), self.read()))
            time.sleep(0.01)

    def stop(self):
        self.on = False
        self.join()

    def joules(self, t0, t1):
        return at(self.rows, t1) - at(self.rows, t0)


class Sampler(threading.Thread):
    """(unix time, watts) every 50 ms from nvidia-smi, integrated as each held to the next."""

    def __init__(self, gpu):
        super().__init__(daemon=True)
        self.rows, self.source = [], "nvidia-smi power samples"
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(gpu), "--query-gpu=power.draw.instant",
             "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, text=True)

    def run(self):
        for line in self.proc.stdout:
            try:
                self.rows.append((time.time(), float(line)))
            except ValueError:  # "[N/A]": skip the sample
                continue

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.join()

    def joules(self, t0, t1):
        r = [x for x in self.rows if t0 <= x[0] <= t1]
        return sum(a[1] * (b[0] - a[0]) for a, b in zip(r, r[1:]))


def at(rows, t):
    """The counter at time t, interpolated between the samples around it."""
    after = next((i for i, r in enumerate(rows) if r[0] >= t), None)
    if after is None or after == 0:
        raise SystemExit(f"energy.py: no counter samples around t = {t:.3f}")
    (ta, ea), (tb, eb) = rows[after - 1], rows[after]
    return ea + (eb - ea) * (t - ta) / (tb - ta)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--runs", required=True, help="the --json file COMMAND appends its line to")
    ap.add_argument("--json", default=None, help="append this script's JSON line to this file")
    ap.add_argument("--tag", default=None, help="a label copied into the JSON line")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command: give it after --")
    if shutil.which("nvidia-smi") is None:
        sys.exit("energy.py: nvidia-smi is not on PATH: run this on the GPU machine")
    try:
        meter = Counter(a.gpu)
    except Exception:  # no pynvml, or no counter on this GPU: sample the power instead
        meter = Sampler(a.gpu)
    meter.start()
    rc = subprocess.call(cmd)
    time.sleep(0.05)
    meter.stop()
    if rc != 0:
        sys.exit(f"energy.py: the command exited with {rc}")
    try:
        with open(a.runs) as f:
            run = json.loads(f.read().splitlines()[-1])
        t0, t1 = run["timed_unix_s"]
    except (OSError, IndexError, KeyError, TypeError, ValueError) as e:
        sys.exit(f"energy.py: no timed_unix_s in the last line of {a.runs} ({e})")
    joules, steps = meter.joules(t0, t1), round((t1 - t0) / run["step_s"])
    tokens = run["micro_batch"] * run["seq"] * steps
    rec = {
        "tag": a.tag, "system": run.get("system", "lora-train"), "source": meter.source,
        "steps": steps, "seconds": round(t1 - t0, 3), "joules": round(joules, 1),
        "step_j": round(joules / steps, 2), "step_ms": round((t1 - t0) / steps * 1e3, 1),
        "mean_w": round(joules / (t1 - t0), 1), "tokens_per_kj": round(tokens / joules * 1e3),
        "tokens_per_s": run.get("tokens_per_s"),
    }
    line = json.dumps(rec)
    print(line, flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
