#!/usr/bin/env python3
"""transformers' greedy `generate` with a static KV cache, timed as `lora-train generate --bench`
times ours: same random-weight shapes (src/bench.rs `shape`), prompt, token counts, JSON fields.

    python3 scripts/bench_generate_hf.py --shape llama2-7b --prompt-len 128 --new-tokens 256
    lora-train generate --bench --shape llama2-7b --prompt-len 128 --max-new-tokens 256

A run is generate(max_new_tokens = 1) for the prefill, and generate(max_new_tokens = N + 1,
min_new_tokens = N + 1) for prefill + N decode steps, with cache_implementation="static"
(bf16, CUDA, eager or sdpa attention, no torch.compile unless --compile); decode time per
token is the difference over N, the mean of --reps runs after one warm-up. The bandwidth
floor is weight bytes (every parameter but the embedding, read once a step) / --bandwidth.
"""
import argparse, json, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# (hidden, intermediate, layers, heads, kv heads, vocab, rope theta), as src/bench.rs.
SHAPES = {
    "tiny": (256, 688, 4, 8, 8, 32000, 10000.0),
    "llama2-7b": (4096, 11008, 32, 32, 32, 32000, 10000.0),
    "llama2-13b": (5120, 13824, 40, 40, 40, 32000, 10000.0),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test only)")
    ap.add_argument("--json", help="also append the JSON line to this file")
    a = ap.parse_args()

    h, i, l, nh, kv, v, theta = SHAPES[a.shape]
    total = a.prompt_len + a.new_tokens + 1
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=l,
                      num_attention_heads=nh, num_key_value_heads=kv, vocab_size=v,
                      rope_theta=theta, max_position_embeddings=max(4096, total),
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=a.attn,
                                              dtype=torch.bfloat16).eval()
    torch.set_default_dtype(torch.float32)
    if a.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, v, (1, a.prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)

    def gen(n):
        sync()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0, cache_implementation="static",
                             temperature=None, top_p=None, top_k=None)
        sync()
        assert out.shape[1] == a.prompt_len + n, out.shape
        return time.perf_counter() - t

    with torch.inference_mode():
        gen(min(a.new_tokens, 8) + 1)  # warm-up: the static cache, cuBLAS handles
        prefill = sum(gen(1) for _ in range(a.reps)) / a.reps
        full = sum(gen(a.new_tokens + 1) for _ in range(a.reps)) / a.reps
    s_per_tok = (full - prefill) / a.new_tokens
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "embed_tokens" not in n)
    kv_row = 2 * l * kv * (h // nh) * 2
    res = {
        "impl": "transformers",
        "shape": a.shape,
        "dtype": "bf16",
        "device": dev.type,
        "kernels": f"{a.attn}{'+compile' if a.compile else ''}, static cache",
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "reps": a.reps,
        "rank": 0,
        "targets": "none",
        "prefill_ms": prefill * 1e3,
        "ms_per_token": s_per_tok * 1e3,
        "tokens_per_s": 1.0 / s_per_tok,
        "weight_bytes": weight_bytes,
        "adapter_bytes": 0,
        "kv_bytes_per_token": kv_row * (a.prompt_len + a.new_tokens // 2),
        "bandwidth_Bps": a.bandwidth,
        "bandwidth_limit_ms": weight_bytes / a.bandwidth * 1e3,
        "bandwidth_fraction": weight_bytes / a.bandwidth / s_per_tok,
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
    }
    line = json.dumps(res)
    print(line)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
