"""Host <-> device copy bandwidth over pinned memory: what activation offload can move a step.

    python3 scripts/pcie_bandwidth.py [--mib 448] [--reps 8] [--json out.json]

Times device-to-host, host-to-device, and both at once on two streams (the copy engines run
each direction on its own), in GB/s (10^9 bytes). 448 MiB is one Llama-3-8B layer's gate and
up at 2 x 4096 tokens in bf16.
"""
import argparse
import json

import torch


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=448)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    n = a.mib << 20
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            host_a.copy_(dev_a, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_b.copy_(host_b, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    d2h = timed(lambda: host_a.copy_(dev_a, non_blocking=True), a.reps)
    h2d = timed(lambda: dev_b.copy_(host_b, non_blocking=True), a.reps)
    duplex = timed(both, a.reps)
    out = {
        "gpu": torch.cuda.get_device_name(),
        "mib": a.mib,
        "d2h_gb_s": n / d2h / 1e9,
        "h2d_gb_s": n / h2d / 1e9,
        "duplex_each_gb_s": n / duplex / 1e9,
    }
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
