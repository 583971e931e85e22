#!/usr/bin/env python3
"""The peer we measure against: LoRA training with transformers + PEFT on PyTorch.

Times the training steps a PEFT user runs, on random weights of a named shape (no download), and
prints one JSON line with the fields of `lora-train bench` (tokens/s, MFU, peak CUDA memory), so
that the two run in one device call and compare as ratios:

  python3 scripts/bench_peft.py --shape llama2-7b --seq 2048 --batch 2 --rank 16 --targets all
  python3 scripts/bench_peft.py --shape llama2-7b --liger           # + Liger-Kernel, as axolotl
  python3 scripts/bench_peft.py --shape llama2-7b --dropout 0.05    # PEFT's lora_dropout
  python3 scripts/bench_peft.py --shape llama2-7b --rslora --tag rslora   # use_rslora, a label
  python3 scripts/bench_peft.py --shape llama2-7b --load-in-4bit    # QLoRA (bitsandbytes NF4)
  python3 scripts/bench_peft.py --shape llama3-8b --seq 32768 --batch 1 --ckpt --max-memory 80GiB
  torchrun --nproc_per_node 2 scripts/bench_peft.py --shape llama2-7b --mode ddp   # or fsdp

Needs torch, transformers and peft (and liger_kernel / bitsandbytes for those flags). --json FILE
appends the line to FILE too. Counting: frozen base, so the backward computes activation
gradients (2 FLOPs per weight) but no weight gradients; attention counted in full, as
`lora-train bench` counts it.
"""
import argparse
import json
import os
import time

import torch

# name: LlamaConfig-style fields (hidden, intermediate, layers, heads, kv heads, vocab, theta)
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, vocab_size=32000, rope_theta=1e4),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      rope_theta=1e4),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                       rope_theta=1e4),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=5e5),
    "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                       rope_theta=1e4),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"qv": ALL[0:3:2], "attn": ALL[:4], "all": ALL}


def args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per GPU")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--dropout", type=float, default=0.0, help="PEFT lora_dropout")
    p.add_argument("--rslora", action="store_true", help="PEFT use_rslora: scale alpha / sqrt(r)")
    p.add_argument("--targets", default="all", choices=sorted(TARGETS))
    p.add_argument("--ckpt", action="store_true", help="gradient checkpointing (non-reentrant)")
    p.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument("--liger", action="store_true", help="Liger-Kernel's RMSNorm, RoPE, SwiGLU, fused linear CE")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: NF4 base (bitsandbytes), double quant")
    p.add_argument("--max-memory", default=None, help="cap, e.g. 80GiB (set_per_process_memory_fraction)")
    p.add_argument("--mode", default="single", choices=["single", "ddp", "fsdp"])
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip as HF Trainer does (its default is 1.0); 0: no clipping, as our history's baseline")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul ceiling for MFU")
    p.add_argument("--json", default=None)
    p.add_argument("--tag", default=None, help="a label copied into the JSON line (a sweep's row)")
    return p.parse_args()


def gib(s):
    units = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6}
    s = s.strip().lower()
    for u, m in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * m
    return float(s)


def flops_per_token(n_linear, layers, hidden, seq, ckpt):
    fwd = 2 * n_linear + 4 * layers * seq * hidden
    bwd = 2 * n_linear + 8 * layers * seq * hidden
    return fwd + bwd + (fwd if ckpt else 0)


def build(a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if a.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    s = SHAPES[a.shape]
    cfg = LlamaConfig(**s, max_position_embeddings=max(4096, a.seq), attn_implementation=a.attn,
                      use_cache=False)
    torch.manual_seed(0)
    if a.load_in_4bit:
        # Random bf16 weights quantized as from_pretrained(load_in_4bit) would quantize them.
        from transformers import BitsAndBytesConfig
        from transformers.quantizers import AutoHfQuantizer
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
        import tempfile
        with torch.device(dev):
            m = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
        tmp = tempfile.mkdtemp()
        m.save_pretrained(tmp)
        del m
        torch.cuda.empty_cache()
        m = LlamaForCausalLM.from_pretrained(tmp, quantization_config=q, device_map={"": dev},
                                             torch_dtype=torch.bfloat16)
        m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=a.ckpt)
    else:
        with torch.device(dev):
            m = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    lora = LoraConfig(r=a.rank, lora_alpha=a.alpha or 2 * a.rank, lora_dropout=a.dropout,
                      use_rslora=a.rslora, target_modules=TARGETS[a.targets], task_type="CAUSAL_LM")
    m = get_peft_model(m, lora)
    if a.ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m, s


def main():
    a = args()
    distributed = a.mode != "single"
    rank, world, local = 0, 1, 0
    if distributed:
        import torch.distributed as tdist
        tdist.init_process_group("nccl")
        rank, world, local = tdist.get_rank(), tdist.get_world_size(), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()  # the CPU only for a smoke run of this script
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if a.max_memory:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib(a.max_memory) / total), dev)

    t0 = time.time()
    model, s = build(a, dev)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Frozen base linears (lm_head included), counted from the shape: 4-bit layers hide theirs.
    h, i, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    n_linear = L * (h * h + 2 * h * kv + h * h + 3 * h * i) + s["vocab_size"] * h
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[local])
    elif a.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    sync()
    load_s = time.time() - t0
    after_load = torch.cuda.memory_allocated(dev) / 2**30 if cuda else 0.0

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    ids = torch.randint(0, s["vocab_size"], (a.batch, a.seq), device=dev, generator=g)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    res = {"system": "transformers+peft" + ("+liger" if a.liger else "") + ("+bnb-nf4" if a.load_in_4bit else ""),
           "torch": torch.__version__, "mode": a.mode, "world": world, "shape": a.shape, "seq": a.seq,
           "micro_batch": a.batch, "lora_rank": a.rank, "targets": a.targets, "ckpt": a.ckpt,
           "dropout": a.dropout, "rslora": a.rslora, "tag": a.tag, "attn": a.attn, "trainable_params": trainable,
           "base_linear_params": n_linear, "load_s": round(load_s, 2),
           "after_load_gib": round(after_load, 2), "max_memory": a.max_memory}
    try:
        for _ in range(a.warmup):
            step()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t1 = time.time()
        for _ in range(a.steps):
            loss = step()
        sync()
        dt = time.time() - t1
    except torch.OutOfMemoryError as e:
        res.update({"oom": True, "error": str(e).splitlines()[0]})
        dt = None
    if dt is not None:
        tps = a.batch * a.seq * a.steps * world / dt
        fpt = flops_per_token(n_linear, L, h, a.seq, a.ckpt)
        res.update({
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 2) if cuda else None,
            "step_s": round(dt / a.steps, 4), "tokens_per_s": round(tps, 1),
            "tokens_per_s_per_gpu": round(tps / world, 1),
            "mfu": round(tps * fpt / (a.peak_tflops * 1e12 * world), 4),
            "final_loss": round(float(loss.detach()), 4),
        })
    if rank == 0:
        print(json.dumps(res), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    if distributed:
        import torch.distributed as tdist
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
