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
  python3 scripts/bench_peft.py --shape gemma2-9b   # or qwen3-8b, gemma3-12b, phi3-mini
  python3 scripts/bench_peft.py --shape qwen3-30b-a3b --ckpt   # MoE: 128 experts, 8 a token
  python3 scripts/bench_peft.py --shape gemma3-12b --layers 1 --seq 16 --batch 1 --steps 1   # CPU smoke
  python3 scripts/bench_peft.py --objective dpo --shape llama2-7b --seq 1024 --prompt-len 512 --batch 4
      # TRL's DPOTrainer + PEFT on pairs (scripts/bench_trl_pref.py; --liger: Liger's fused DPO loss)

Needs torch, transformers and peft (and liger_kernel / bitsandbytes for those flags). --json FILE
appends the line to FILE too. Counting: frozen base, so the backward computes activation
gradients (2 FLOPs per weight) but no weight gradients; attention counted in full, as
`lora-train bench` counts it.

Each shape is built with its own transformers class (LlamaForCausalLM, Qwen3ForCausalLM,
Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM) and that class's default attention unless
--attn names one; the JSON's attn_impl says which ran (Gemma 2's default may drop the attention
soft-cap, as sdpa has none: a speed peer, not a reference). Phi-3's targets are its fused
projections (all: qkv_proj, o_proj, gate_up_proj, down_proj).

Qwen3-MoE (Qwen3MoeForCausalLM): --targets all is the attention's linears (target_modules) and
the experts' fused 3-D parameters (target_parameters = mlp.experts.gate_up_proj,
mlp.experts.down_proj, as our fixtures, scripts/reference_moe.py), the router not adapted; the
experts run transformers' --experts implementation (default grouped_mm, torch's grouped GEMM;
the JSON's experts_impl says which ran, experts_kernel which kernel under it). The FLOP count
takes the k experts a token is routed to and the router, as `lora-train bench` counts them.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch

# name: (family, config fields). Llama: hidden, intermediate, layers, heads, kv heads, vocab,
# theta. The others: the released model's config.json fields, as src/bench.rs `shape` has them.
def _llama(h, i, layers, nh, kv, vocab, theta):
    return ("llama", dict(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                          num_attention_heads=nh, num_key_value_heads=kv, vocab_size=vocab,
                          rope_theta=theta))


SHAPES = {
    "tiny": _llama(256, 688, 4, 8, 8, 32000, 1e4),
    "llama2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 1e4),
    "llama2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 1e4),
    # meta-llama/Llama-3.1-8B: llama3 rope scaling to 131072 positions
    "llama3-8b": ("llama", dict(_llama(4096, 14336, 32, 32, 8, 128256, 5e5)[1],
                                max_position_embeddings=131072,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})),
    "llama2-70b": _llama(8192, 28672, 80, 64, 8, 32000, 1e4),
    # Qwen/Qwen3-8B
    "qwen3-8b": ("qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False)),
    # google/gemma-2-9b: sliding window on every other layer, attention and final soft-caps
    "gemma2-9b": ("gemma2", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # google/gemma-3-12b's text model: 5 sliding (window 1024, rope base 1e4) : 1 global
    # (rope base 1e6, linear scaling x8) layers
    "gemma3-12b": ("gemma3_text", dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=262208, query_pre_attn_scalar=256,
        sliding_window=1024, sliding_window_pattern=6, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6, max_position_embeddings=131072,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # microsoft/Phi-3.5-mini-instruct without its LongRoPE (which acts past 4096 tokens):
    # fused qkv_proj and gate_up_proj
    "phi3-mini": ("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, rope_theta=1e4, rms_norm_eps=1e-5,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        sliding_window=None, tie_word_embeddings=False, hidden_act="silu")),
    # Qwen/Qwen3-30B-A3B: every layer sparse, 128 experts of width 768, 8 a token (renormalised)
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False, attention_bias=False)),
    # openai/gpt-oss-20b with bf16 experts (src/model/shapes.rs): 32 experts of width 2880, 4 a
    # token; sliding (128) and full layers alternating, sinks, YaRN, biases (eager attention:
    # transformers has no SDPA path with sinks)
    "gpt-oss-20b": ("gpt_oss", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
        swiglu_limit=7.0, tie_word_embeddings=False)),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"qv": ALL[0:3:2], "attn": ALL[:4], "all": ALL}
# Phi-3's fused projections ("qv": the fused qkv_proj, as PEFT's default for it and src/bench.rs)
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
TARGETS_FUSED = {"qv": FUSED[:1], "attn": FUSED[:2], "all": FUSED}
# A MoE's: (target_modules, target_parameters); "all" adds the experts' fused parameters
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGETS_MOE = {"qv": (ALL[0:3:2], []), "attn": (ALL[:4], []), "all": (ALL[:4], EXPERTS)}
MOE_FAMILIES = {"qwen3_moe", "gpt_oss"}


def lora_targets(family, name):
    """(target_modules, target_parameters) of --targets `name` for a family."""
    if family in MOE_FAMILIES:
        return TARGETS_MOE[name]
    return (TARGETS_FUSED if family == "phi3" else TARGETS)[name], []


def family_classes(family):
    """(config class, causal-LM class, Liger patch name) of a family."""
    import transformers as tf
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "apply_liger_kernel_to_gemma2"),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", "apply_liger_kernel_to_gemma3_text"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", "apply_liger_kernel_to_phi3"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "apply_liger_kernel_to_qwen3_moe"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "apply_liger_kernel_to_gpt_oss"),
    }[family]
    return getattr(tf, names[0]), getattr(tf, names[1]), names[2]


def dims(s):
    """(hidden, intermediate, layers, q width, kv width, vocab) of a shape's fields."""
    h, nh = s["hidden_size"], s["num_attention_heads"]
    d = s.get("head_dim") or h // nh
    return (h, s["intermediate_size"], s["num_hidden_layers"], nh * d,
            s["num_key_value_heads"] * d, s["vocab_size"])


def base_linear_params(s):
    """Frozen linear weights a token multiplies (the head counted even when tied), as
    src/bench.rs base_linear_params: per layer q (h x q), k and v (h x kv), o (q x h), gate and up
    (h x i), down (i x h); Phi-3's fused qkv_proj (h x (q + 2kv)) and gate_up_proj (h x 2i) sum
    alike. A MoE layer: its k routed experts' gate_up and down (3 x h x moe_i each) and the
    router (experts x h) in place of the dense MLP."""
    h, i, layers, q, kv, vocab = dims(s)
    attn = h * q + 2 * h * kv + q * h
    experts = s.get("num_experts", s.get("num_local_experts"))  # gpt-oss: num_local_experts
    if experts:
        moe_i = s.get("moe_intermediate_size", i)  # gpt-oss: intermediate_size is the expert's
        mlp = s["num_experts_per_tok"] * 3 * h * moe_i + experts * h
    else:
        mlp = 3 * h * i
    return layers * (attn + mlp) + vocab * h


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
    p.add_argument("--attn", default=None,
                   help="transformers attn_implementation (default: the model class's own choice;"
                        " the JSON's attn_impl says which ran)")
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="a MoE's transformers experts_implementation (grouped_mm: torch's grouped GEMM,"
                        " the fastest without Hub kernels; the JSON's experts_impl says which ran)")
    p.add_argument("--layers", type=int, default=None,
                   help="override num_hidden_layers (a smoke run of a large shape on the CPU)")
    p.add_argument("--liger", action="store_true", help="Liger-Kernel's RMSNorm, RoPE, SwiGLU, fused linear CE")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: NF4 base (bitsandbytes), double quant")
    p.add_argument("--max-memory", default=None, help="cap, e.g. 80GiB (set_per_process_memory_fraction)")
    p.add_argument("--mode", default="single", choices=["single", "ddp", "fsdp"])
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip as HF Trainer does (its default is 1.0); 0: no clipping, as our history's baseline")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul ceiling for MFU")
    p.add_argument("--objective", default="sft", choices=["sft", "dpo"],
                   help="dpo: TRL's DPOTrainer on random pairs of --seq tokens a sequence, --batch pairs"
                        " (scripts/bench_trl_pref.py)")
    p.add_argument("--prompt-len", type=int, default=512,
                   help="dpo: the prompt tokens of each pair (of --seq), as `lora-train bench --prompt-len`")
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
    # attention counted causally: a token attends to seq / 2 keys on average
    fwd = 2 * n_linear + 2 * layers * seq * hidden
    bwd = 2 * n_linear + 4 * layers * seq * hidden
    return fwd + bwd + (fwd if ckpt else 0)


def experts_kernel(model, impl):
    """What runs a MoE's experts: the implementation, and for grouped_mm the kernel transformers
    dispatches to on these weights (torch's grouped GEMM, or its per-expert fallback loop)."""
    if impl != "grouped_mm":
        return impl
    w = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except ImportError:
        return "grouped_mm (kernel unknown)"
    offs = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
    if not _can_use_grouped_mm(w.new_empty(0, w.shape[-1]), w, offs):
        return "grouped_mm -> transformers' per-expert fallback"
    if hasattr(torch.nn.functional, "grouped_mm"):
        return "grouped_mm (torch.nn.functional.grouped_mm)"
    return "grouped_mm (torch._grouped_mm)"


def build(a, dev):
    """(PEFT model, shape fields, experts implementation or None): random bf16 weights made on
    `dev` (no float32 copy, no host round trip), LoRA on --targets."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    family, s = SHAPES[a.shape]
    s = dict(s)
    moe = family in MOE_FAMILIES
    if a.layers is not None:
        s["num_hidden_layers"] = a.layers
        if family == "gemma3_text":  # keep a global layer among the sliding ones
            s["sliding_window_pattern"] = min(s["sliding_window_pattern"], a.layers)
        if "layer_types" in s:  # gpt-oss: its alternation, cut to the layers
            s["layer_types"] = s["layer_types"][: a.layers]
    if moe and a.load_in_4bit:
        raise SystemExit("--load-in-4bit: bitsandbytes does not quantize the experts' 3-D "
                         "parameters; bench a MoE shape without it")
    Config, ForCausalLM, liger = family_classes(family)
    if a.liger:
        import liger_kernel.transformers as lk
        getattr(lk, liger)()
    s["max_position_embeddings"] = max(s.get("max_position_embeddings", 4096), 4096, a.seq)
    kw = {} if a.attn is None else dict(attn_implementation=a.attn)
    cfg = Config(**s, use_cache=False, **kw)
    torch.manual_seed(0)
    if a.load_in_4bit:
        # Random bf16 weights quantized as from_pretrained(load_in_4bit) would quantize them.
        from transformers import BitsAndBytesConfig
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
        import tempfile
        with torch.device(dev):
            m = ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        tmp = tempfile.mkdtemp()
        m.save_pretrained(tmp)
        del m
        torch.cuda.empty_cache()
        m = ForCausalLM.from_pretrained(tmp, quantization_config=q, device_map={"": dev},
                                        dtype=torch.bfloat16, **kw)
        m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=a.ckpt)
    else:
        # the parameters are allocated on `dev` in bf16 and initialised there
        mkw = dict(experts_implementation=a.experts) if moe else {}
        with torch.device(dev):
            m = ForCausalLM._from_config(cfg, dtype=torch.bfloat16, **mkw)
    experts = experts_kernel(m, m.config._experts_implementation) if moe else None
    modules, params = lora_targets(family, a.targets)
    extra = dict(target_parameters=params) if params else {}
    lora = LoraConfig(r=a.rank, lora_alpha=a.alpha or 2 * a.rank, lora_dropout=a.dropout,
                      use_rslora=a.rslora, target_modules=modules, task_type="CAUSAL_LM", **extra)
    # a MoE's expert adapters (640M parameters at r 16) made on the GPU, not the host
    with torch.device(dev) if moe else contextlib.nullcontext():
        m = get_peft_model(m, lora)
    if a.ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m, s, experts


def build_base(a, dev):
    """(random bf16 model of --shape on `dev`, shape fields, LoRA target modules), no adapters:
    for a trainer that adds them itself (TRL's, with peft_config)."""
    family, s = SHAPES[a.shape]
    s = dict(s)
    if family in MOE_FAMILIES or a.load_in_4bit or a.mode != "single":
        raise SystemExit("--objective dpo: a dense shape, bf16, --mode single")
    if a.layers is not None:
        s["num_hidden_layers"] = a.layers
    Config, ForCausalLM, _ = family_classes(family)
    s["max_position_embeddings"] = max(s.get("max_position_embeddings", 4096), 4096, a.seq)
    kw = {} if a.attn is None else dict(attn_implementation=a.attn)
    cfg = Config(**s, use_cache=False, **kw)
    torch.manual_seed(0)
    with torch.device(dev):
        m = ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    return m, s, lora_targets(family, a.targets)[0]


def main():
    a = args()
    if a.objective != "sft":
        import bench_trl_pref
        sys.exit(bench_trl_pref.run(a, build_base, dims, flops_per_token, base_linear_params))
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
    model, s, experts = build(a, dev)
    if experts is not None:
        print(f"experts: {experts}", file=sys.stderr, flush=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Frozen base linears (lm_head included), counted from the shape: 4-bit layers hide theirs.
    h, L = s["hidden_size"], s["num_hidden_layers"]
    n_linear = base_linear_params(s)
    attn_impl = model.base_model.model.config._attn_implementation
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
           "dropout": a.dropout, "rslora": a.rslora, "tag": a.tag, "attn": a.attn or "default", "attn_impl": attn_impl,
           "family": SHAPES[a.shape][0], "layers": L, "trainable_params": trainable,
           "experts_impl": experts,
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
            "step_s": round(dt / a.steps, 4), "timed_unix_s": [t1, t1 + dt], "tokens_per_s": round(tps, 1),
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
