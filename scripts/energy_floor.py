#!/usr/bin/env python3
"""The energy a training step's parts take alone at the power limit: the floor under a step.

    python3 scripts/energy_floor.py [--shape llama2-7b] [--seq 2048] [--batch 2] [--seconds 6]
                                    [--parts gemms attention memory idle] [--json F]

A LoRA step's frozen GEMMs are the same for every trainer: each linear's forward x·Wᵀ and its
backward g·W (no dL/dW: the base is frozen; none for layer 0's q, k and v, whose input is the
embedding's, nor for the embedding), the head's forward and backward. On a GPU held at its power
limit a step's time follows its energy (BENCHMARKS.md, "Where the time goes"), so the joules
these GEMMs take alone bound every trainer's step from below, and what a trainer spends above
them is what its other passes cost. Each part runs as one step's worth, repeated for `--seconds`
after a burst of as long again (to reach the limit and the clocks it holds), its energy read
from NVML's counter (scripts/energy.py's reader) over the timed window:

  gemms      one step's frozen GEMMs on cuBLAS (torch.mm: cuBLASLt's heuristic pick), q, k and v
             as one product and gate and up as one (as lora-train runs them), every layer its
             own random weights: joules, milliseconds and watts a step, TFLOP/s, pJ a FLOP
  attention  causal attention's forward and backward at the shape ([B, H, T, D] each layer),
             torch's flash kernels (FlashAttention-2): joules a step, TFLOP/s
  memory     a bf16 copy of 1 GiB, repeated: joules a GB moved (read plus write), i.e. what one
             pass over an activation costs
  idle       the GPU waiting, right after the burst: watts

It prints a JSON line a part (and appends them to --json).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peft import SHAPES  # noqa: E402  (the named shapes, one table for both scripts)
from energy import Counter  # noqa: E402

DEV = "cuda"


def timed(step, seconds, meter):
    """Runs step() for `seconds` (a burst), then for `seconds` more, timed: (steps, s, J)."""
    end = time.time() + seconds
    while time.time() < end:
        step()
    torch.cuda.synchronize()
    n, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        step()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    t1 = time.time()
    time.sleep(0.05)  # the counter's next sample lies past t1
    return n, t1 - t0, meter.joules(t0, t1)


def dims(shape):
    """(hidden C, mlp I, vocab V, layers, heads H, kv heads, head dim D) of a dense shape."""
    family, f = SHAPES[shape]
    if family == "qwen3_moe":
        sys.exit("energy_floor.py: a dense shape, please (the MoE's experts are not modelled)")
    c, h = f["hidden_size"], f["num_attention_heads"]
    return (c, f["intermediate_size"], f["vocab_size"], f["num_hidden_layers"], h,
            f["num_key_value_heads"], f.get("head_dim", c // h))


def gemms(cfg, m, seconds, meter):
    c, i, v, layers, h, kvh, d = cfg
    qkv = (h + 2 * kvh) * d
    dev, dt = DEV, torch.bfloat16

    def w(o, k):
        return torch.randn(o, k, device=dev, dtype=dt) * 0.02

    ws = [(w(qkv, c), w(c, h * d), w(2 * i, c), w(c, i)) for _ in range(layers)]
    head = w(v, c)
    cols = [("c", c), ("hd", h * d), ("i", i), ("qkv", qkv), ("gu", 2 * i), ("v", v)]
    a = {n: torch.randn(m, k, device=dev, dtype=dt) for n, k in cols}
    out = {n: torch.empty(m, k, device=dev, dtype=dt) for n, k in cols}

    def step():
        for wq, wo, wgu, wd in ws:  # forward
            torch.mm(a["c"], wq.t(), out=out["qkv"])
            torch.mm(a["hd"], wo.t(), out=out["c"])
            torch.mm(a["c"], wgu.t(), out=out["gu"])
            torch.mm(a["i"], wd.t(), out=out["c"])
        torch.mm(a["c"], head.t(), out=out["v"])
        torch.mm(a["v"], head, out=out["c"])  # the head's dL/dx
        for l, (wq, wo, wgu, wd) in reversed(list(enumerate(ws))):  # backward: dL/dx only
            torch.mm(a["c"], wd, out=out["i"])
            torch.mm(a["gu"], wgu, out=out["c"])
            torch.mm(a["c"], wo, out=out["hd"])
            if l > 0:
                torch.mm(a["qkv"], wq, out=out["c"])

    per_layer = qkv * c + c * h * d + 2 * i * c + c * i
    flop = 2 * m * (2 * per_layer * layers - qkv * c + 2 * v * c)
    n, s, j = timed(step, seconds, meter)
    return {"flop": flop, "tflops": round(flop * n / s / 1e12, 1),
            "pj_per_flop": round(j / (flop * n) * 1e12, 4), **per_step(n, s, j)}


def attention(cfg, batch, seq, seconds, meter):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layers, h, d = cfg[3], cfg[4], cfg[6]
    shape = (batch, h, seq, d)
    # k and v at the query heads' count: the flash kernels' cost is the queries' (GQA reads less)
    q, k, v = (torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(shape, device=DEV, dtype=torch.bfloat16)

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for _ in range(layers):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(o, (q, k, v), g)  # fresh gradients: no accumulating pass

    # causal: each T×T×D product is half of 2·B·H·T²·D; 2 forward, 5 backward (S again, dP,
    # dV, dK, dQ)
    flop = 7 * batch * h * seq * seq * d * layers
    n, s, j = timed(step, seconds, meter)
    return {"flop": flop, "tflops": round(flop * n / s / 1e12, 1), **per_step(n, s, j)}


def memory(seconds, meter):
    a = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    b = torch.empty_like(a)
    n, s, j = timed(lambda: b.copy_(a), seconds, meter)
    gb = 2 * a.numel() * a.element_size() / 1e9
    return {"gb_moved": round(gb * n, 1), "gb_per_s": round(gb * n / s, 1),
            "j_per_gb": round(j / (gb * n), 4), "mean_w": round(j / s, 1)}


def idle(seconds, meter):
    torch.cuda.synchronize()
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    time.sleep(0.05)
    return {"mean_w": round(meter.joules(t0, t1) / (t1 - t0), 1)}


def per_step(n, s, j):
    return {"steps": n, "step_ms": round(s / n * 1e3, 2), "step_j": round(j / n, 2),
            "mean_w": round(j / s, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--parts", nargs="+", default=["gemms", "attention", "memory", "idle"],
                    choices=["gemms", "attention", "memory", "idle"])
    ap.add_argument("--json", default=None, help="append the JSON lines to this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("energy_floor.py: no CUDA device: run this on the GPU machine")
    if not 0 < a.seconds <= 120 or not 0 < a.seq * a.batch <= 1 << 20:
        sys.exit("energy_floor.py: --seconds is 0-120, --seq × --batch at most 1,048,576")
    torch.cuda.set_device(a.gpu)
    meter = Counter(a.gpu)  # NVML's energy counter; this script needs it (no power sampling)
    meter.start()
    cfg = dims(a.shape)
    m = a.seq * a.batch
    run = {"gemms": lambda: gemms(cfg, m, a.seconds, meter),
           "attention": lambda: attention(cfg, a.batch, a.seq, a.seconds, meter),
           "memory": lambda: memory(a.seconds, meter),
           "idle": lambda: idle(a.seconds, meter)}
    for part in a.parts:
        rec = {"part": part, "shape": a.shape, "seq": a.seq, "batch": a.batch,
               "gpu": torch.cuda.get_device_name(), **run[part]()}
        torch.cuda.empty_cache()
        line = json.dumps(rec)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    meter.stop()


if __name__ == "__main__":
    main()
