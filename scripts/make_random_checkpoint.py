#!/usr/bin/env python3
"""A random checkpoint of a named shape, saved as transformers saves a real one (config.json,
bf16 safetensors in 5 GB shards with their index), and rows of random token ids, so that the
`train` command a user runs is timed at full size where no Hub model can be downloaded:

  python3 scripts/make_random_checkpoint.py /tmp/llama2-7b llama2-7b --seq 2048 --rows 400

Weights are N(0, 0.02) as transformers initialises a fresh model (norms 1), made on the GPU when
there is one (~30 s for 7B). data.jsonl holds `--rows` rows of `--seq` ids ({"input_ids": [...]},
lora-train's format = "tokens").
"""
import argparse
import json
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench_peft import SHAPES

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("out")
p.add_argument("shape", choices=sorted(k for k, (f, _) in SHAPES.items() if f == "llama"))
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--rows", type=int, default=400)
a = p.parse_args()

family, s = SHAPES[a.shape]
if family != "llama":
    p.error(f"{a.shape} is a {family} shape; this script makes Llama-family checkpoints")
s = dict(s)
s["max_position_embeddings"] = max(s.get("max_position_embeddings", 0), 4096, a.seq)
cfg = LlamaConfig(**s, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(a.out, safe_serialization=True, max_shard_size="5GB")
rng = random.Random(0)
with open(f"{a.out}/data.jsonl", "w") as f:
    for _ in range(a.rows):
        f.write(json.dumps({"input_ids": [rng.randrange(s["vocab_size"]) for _ in range(a.seq)]}) + "\n")
print("wrote", a.out)
