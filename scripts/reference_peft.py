#!/usr/bin/env python3
"""Golden references from transformers + PEFT for lora-train's CPU tests.

Run where torch, transformers and peft are installed (the device machine has them):

    python3 scripts/reference_peft.py --out tests/fixtures/golden

For each case it writes <out>/<case>/:
  model/           config.json + safetensors (f32; sharded for one case), unless the case uses
                   the tiny model we ship (recipes/assets/tiny-llama)
  init_adapter/    PEFT adapter (A kaiming as PEFT inits it, B random non-zero), saved by PEFT
  train.jsonl      8 rows {"input_ids", "labels"} of varied length: 4 steps of micro-batch 2
  golden.safetensors
      logits         [2, T, V]  forward of batch 0 (rows 0-1 padded to T) with the init adapter
      loss           [1]        transformers' causal-LM loss of that batch (shifted, -100 ignored)
      grad.<key>     dL/d(lora param) of that loss, key = PEFT's adapter key
      after.<key>    the adapter after 4 AdamW steps over train.jsonl in file order
      train_losses   [4]        loss of each of those steps
  meta.json        the case's LoRA and optimiser settings, for the Rust test to mirror

Compute runs in float64 on the CPU from the f32 weights, so the references carry no f32
rounding of their own; tests compare our f32 CPU run at rtol 1e-4.
"""
import argparse, json, math, os, shutil, sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, get_cosine_schedule_with_warmup
from peft import LoraConfig, get_peft_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = {
    # Llama, GQA (4 heads, 2 kv), untied head, sharded safetensors, all-linear adapters.
    "llama_gqa": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False),
        lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"],
                  use_rslora=False),
        shard="40KB"),
    # Llama, MHA, tied head, Llama-3 rope scaling, rsLoRA on q/v.
    "llama_mha_tied_rope3": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16),
                    tie_word_embeddings=True),
        lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True)),
    # Qwen2: q/k/v bias, one kv head, tied head, theta 1e6.
    "qwen2_bias": dict(
        config=dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True),
        lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"],
                  use_rslora=False)),
    # Mistral with an explicit head_dim (16) != hidden/heads (12), untied, mixed targets.
    "mistral_head_dim": dict(
        config=dict(model_type="mistral", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    sliding_window=4096, tie_word_embeddings=False),
        lora=dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
                  use_rslora=False)),
    # The tiny model we ship, read by transformers from its 4.x-style config.json.
    "tiny_shipped": dict(
        shipped="recipes/assets/tiny-llama",
        lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"],
                  use_rslora=False)),
    # Llama 3.2: tied head, GQA, llama3 rope (all three frequency bands at head_dim 16) and
    # rows of 34-44 tokens, past original_max_position_embeddings = 32.
    "llama32_tied_long": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=32),
                    tie_word_embeddings=True),
        rows=(40, 34, 44),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
    # Qwen3: QK-norm (random gains), head_dim 16 != 48 / 4, GQA, no bias, tied head.
    "qwen3_qk_norm": dict(
        config=dict(model_type="qwen3", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
    # Gemma 2: (1 + w) norms, four a layer; √C embedding; GeGLU; query_pre_attn_scalar 20;
    # soft-caps that bind (attention 0.6, logits 2.0); layer 0 slides (window 5 < 12 tokens),
    # layer 1 attends fully; head_dim 16 != 48 / 4; tied head. Eager attention: sdpa drops
    # the attention cap (meta.json's sdpa_vs_eager says by how much here).
    "gemma2_softcap": dict(
        config=dict(model_type="gemma2", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                    query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=0.6,
                    final_logit_softcapping=2.0, tie_word_embeddings=True),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
    # Gemma 3 (text): QK-norm with (1 + w) gains, 5 sliding layers (window 5) : 1 global, the
    # sliding ones on a local rope base 1e4, the global one on 1e6 with linear scaling ×8;
    # head_dim 24 != 32 / 2; one kv head; rsLoRA.
    "gemma3_local_global": dict(
        config=dict(model_type="gemma3_text", hidden_size=32, intermediate_size=48,
                    num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                    vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
                    query_pre_attn_scalar=24, sliding_window=5, tie_word_embeddings=True,
                    rope_parameters={
                        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                        "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=True)),
    # Phi-3: fused qkv_proj and gate_up_proj (PEFT's keys), GQA, LongRoPE with random short and
    # long factors (batch 0 reaches past original_max_position_embeddings = 8, the others do
    # not), a sliding window of 7.
    "phi3_fused_longrope": dict(
        config=dict(model_type="phi3", hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=32, original_max_position_embeddings=8,
                    rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=7,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                    rope_scaling=dict(rope_type="longrope", short_factor="random",
                                      long_factor="random")),
        rows=(12, 5, 8),
        lora=dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                      "down_proj"], use_rslora=False)),
}

OPT = dict(lr=2e-2, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, max_grad_norm=0.5,
           schedule="cosine", warmup_steps=1, steps=4, micro_batch=2)


def peft_key(name):
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> PEFT file key
    return name.replace(".default", "")


def batch_of(rows, pad):
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
    return ids, labels


def make_rows(g, vocab, lens=(12, 6, 12)):
    """Rows 0 and 1 (batch 0) of lens[0] tokens, the others of lens[1] to lens[2]."""
    first, lo, hi = lens
    rows = []
    for k in range(2 * OPT["steps"]):
        n = first if k < 2 else lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = list(ids)
        # uneven numbers of counted tokens: mask a prompt-like prefix or single tokens
        if k % 2 == 0:
            labels[:3] = [-100] * 3
        else:
            labels[n // 2] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def make_config(c):
    """A config from 4.x-style fields, written the way the installed transformers wants them
    (5.x keeps rope_theta / rope_scaling in rope_parameters), so save_pretrained writes the
    installed version's format: the Rust loader must read it."""
    import transformers
    c = dict(c)
    if "rope_parameters" in c:  # already per layer type (Gemma 3)
        cfg = AutoConfig.for_model(**c)
        print("  config rope:", cfg.to_dict()["rope_parameters"], flush=True)
        return cfg
    theta = c.pop("rope_theta")
    scaling = c.pop("rope_scaling", None)
    if int(transformers.__version__.split(".")[0]) >= 5:
        rp = {"rope_type": "default", "rope_theta": theta}
        rp.update(scaling or {})
        c["rope_parameters"] = rp
    else:
        c["rope_theta"] = theta
        c["rope_scaling"] = scaling
    cfg = AutoConfig.for_model(**c)
    print("  config rope:", {k: v for k, v in cfg.to_dict().items() if "rope" in k}, flush=True)
    return cfg


def run_case(name, case, out):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    if "shipped" in case:
        model_dir = os.path.join(ROOT, case["shipped"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
    else:
        c = dict(case["config"])
        sc = c.get("rope_scaling")
        if sc and sc.get("short_factor") == "random":  # LongRoPE's per-frequency factors
            half = (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) // 2
            c["rope_scaling"] = dict(sc, **{
                k: [round(1.0 + 3.0 * float(torch.rand(1, generator=g)), 3) for _ in range(half)]
                for k in ("short_factor", "long_factor")})
        cfg = make_config(c)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
        gemma = cfg.model_type.startswith("gemma")
        with torch.no_grad():  # larger weights than the default 0.02 so every path matters
            for pname, p in model.named_parameters():
                if "norm" in pname and gemma:  # Gemma's gain is 1 + w
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                elif "norm" in pname:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif pname.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                elif "embed" in pname:
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        model_dir = os.path.join(d, "model")
        kw = {"max_shard_size": case["shard"]} if "shard" in case else {}
        model.save_pretrained(model_dir, safe_serialization=True, **kw)
    vocab = model.config.vocab_size

    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **case["lora"])
    pm = get_peft_model(model, lcfg)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(os.path.join(d, "init_adapter"))

    rows = make_rows(g, vocab, case.get("rows", (12, 6, 12)))
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    pm = pm.double()
    lora_params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]
    out_t = {}
    ids, labels = batch_of(rows[:2], pad)
    res = pm(input_ids=ids, labels=labels)
    res.loss.backward()
    sdpa_vs_eager = None
    if getattr(model.config, "attn_logit_softcapping", None):
        # What the default attention would have given: sdpa has no soft-cap.
        with torch.no_grad():
            model.config._attn_implementation = "sdpa"
            lo = pm(input_ids=ids).logits
            model.config._attn_implementation = "eager"
        sdpa_vs_eager = (lo - res.logits).abs().max().item()
        print(f"  {name}: sdpa vs eager logits differ by up to {sdpa_vs_eager:.3f}", flush=True)
    out_t.update(first_step(res, pm, lora_params))

    def loss_of(rs):
        ids, labels = batch_of(rs, pad)
        return pm(input_ids=ids, labels=labels).loss

    losses = adamw_steps(loss_of, rows, lora_params)
    save_golden(d, out_t, lora_params, losses)
    meta = dict(case=name, model_dir=("../../../../" + case["shipped"]) if "shipped" in case else "model",
                lora=case["lora"], opt=OPT, pad_id=pad, loss=out_t["loss"].item(), train_losses=losses,
                sdpa_vs_eager=sdpa_vs_eager,
                versions=versions())
    write_meta(d, meta)



def first_step(res, pm, lora_params):
    """A golden's first step, from the forward `res` of rows 0-1 whose loss has had its backward:
    its logits, loss and each adapter's gradient (float32), the gradients then cleared."""
    out = {"logits": res.logits.detach().float(), "loss": res.loss.detach().float().reshape(1)}
    for k, p in lora_params:
        out["grad." + k] = p.grad.detach().float().clone()
    pm.zero_grad(set_to_none=True)
    return out


def adamw_steps(loss_of, rows, lora_params):
    """The goldens' training: OPT["steps"] steps, step s on rows 2s and 2s + 1 (`loss_of(rows)`
    their mean loss), each clipped to OPT["max_grad_norm"], torch's AdamW under HF's cosine
    schedule with warm-up; the losses as floats."""
    params = [p for _, p in lora_params]
    opt = torch.optim.AdamW(params, lr=OPT["lr"], betas=tuple(OPT["betas"]), eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, OPT["warmup_steps"], OPT["steps"])
    losses = []
    for s in range(OPT["steps"]):
        loss = loss_of(rows[2 * s: 2 * s + 2])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPT["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def save_golden(d, out_t, lora_params, losses):
    """<d>/golden.safetensors: `out_t` (the first step's), each adapter after the steps
    ("after.<key>") and the steps' losses, float32."""
    for k, p in lora_params:
        out_t["after." + k] = p.detach().float().clone()
    out_t["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in out_t.items()}, os.path.join(d, "golden.safetensors"),
              metadata={"format": "pt"})


def versions(**more):
    """The library versions a fixture was made with (meta.json's "versions")."""
    return dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                peft=__import__("peft").__version__, **more)


def write_meta(d, meta):
    """<d>/meta.json, and the case's losses on stdout."""
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    losses = ['%.5f' % l for l in meta["train_losses"]]
    print(f"{meta['case']}: loss {meta['loss']:.6f} train {losses}", flush=True)


def run_cases(cases, run_case):
    """The scripts' command line: --out DIR, --case NAME (repeatable); every case is tried and
    the failed ones are named at the end (exit 1)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/golden"))
    ap.add_argument("--case", action="append")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    failed = []
    for name, case in cases.items():
        if a.case and name not in a.case:
            continue
        try:
            run_case(name, case, a.out)
        except Exception:
            import traceback
            traceback.print_exc()
            failed.append(name)
    if failed:
        sys.exit(f"failed cases: {failed}")


if __name__ == "__main__":
    run_cases(CASES, run_case)
