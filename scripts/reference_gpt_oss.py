#!/usr/bin/env python3
"""Golden reference for gpt-oss from transformers (eager) + PEFT, in float64.

A sibling of scripts/reference_moe.py (same helpers, same layout of <out>/<case>/, the same
optimiser for 6 steps): a tiny gpt-oss with every part of the family that differs from the
others:

  - attention sinks (self_attn.sinks [H], drawn N(0, 1)), q/k/v/o with biases;
  - a sliding layer (window 4 over rows of 12 tokens) and a full one;
  - YaRN rope (factor 8 over an original context of 32, betas 32 / 1, not truncated);
  - experts as transformers stores them, x·W: gate_up_proj [E, C, 2I] (gate and up
    interleaved in its columns) and down_proj [E, I, C], each with its bias; gate_up drawn wide
    (N(0, 1.2²)) so the clamped SwiGLU's clamps (limit 7.0) bite on both gate and up;
  - the router with its bias, the top 2 of 8 logits and a softmax over those, drawn so that in
    batch 0 each layer leaves one or two experts idle;
  - LoRA on q/k/v/o (target_modules) and on both expert parameters (PEFT's target_parameters),
    B drawn non-zero.

    python3 scripts/reference_gpt_oss.py --out tests/fixtures/golden
"""
import copy, json, os, shutil, sys

import torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import OPT, adamw_steps, batch_of, first_step, make_config, make_rows, peft_key, run_cases, save_golden, versions, write_meta  # noqa: E402
from reference_moe import with_adapter  # noqa: E402

OPT["steps"] = 6  # make_rows draws 2 rows a step

BASE = dict(model_type="gpt_oss", hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=150000.0,
            rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                              original_max_position_embeddings=32, truncate=False),
            num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], attention_bias=True,
            tie_word_embeddings=False, swiglu_limit=7.0, pad_token_id=0)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

CASES = {
    "gpt_oss": dict(config=BASE, lora=dict(r=4, lora_alpha=8, target_modules=ATTN,
                                           target_parameters=EXPERTS, use_rslora=False)),
}


def counts(pm, ids, n_exp):
    """Tokens routed to each expert, per layer, for batch `ids` (a hook on the routers)."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, i, o: got.append(
        torch.bincount(o[2].reshape(-1), minlength=n_exp).tolist()))
        for n, m in pm.named_modules() if n.endswith("mlp.router")]
    with torch.no_grad():
        pm(input_ids=ids)
    for h in hooks:
        h.remove()
    return got


def stressed(per_layer):
    return all(0 < sum(n == 0 for n in c) <= 2 for c in per_layer)


def stress_routing(model, lcfg, g, rows, n_exp):
    """Redraws the routers (N(0, 0.5²), bias N(0, 0.3²)) until batch 0 under the init adapter
    leaves one or two experts idle in each layer."""
    ids, _ = batch_of(rows, 0)
    state = g.get_state()
    for attempt in range(1000):
        gen = torch.Generator().manual_seed(1000 + attempt)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("mlp.router.weight"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                elif n.endswith("mlp.router.bias"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        g.set_state(state)
        torch.manual_seed(0)  # PEFT's kaiming init of A draws from the global stream
        probe = with_adapter(copy.deepcopy(model), lcfg, g).double()
        if stressed(counts(probe, ids, n_exp)):
            g.set_state(state)
            torch.manual_seed(0)
            return
    raise SystemExit("no router draw stresses routing")


def clamp_share(pm, ids):
    """The share of gate and up entries past the clamp in batch 0 (gate > 7, |up| > 7), of the
    base experts' products."""
    seen = []

    def hook(mod, inp, out):
        x, idx = inp[0], inp[1]
        for e in idx.unique():
            gu = x @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
            seen.append(((gu[..., ::2] > 7).float().mean().item(),
                         (gu[..., 1::2].abs() > 7).float().mean().item()))
    hooks = [m.register_forward_hook(hook) for m in pm.modules()
             if type(m).__name__ == "GptOssExperts"]
    with torch.no_grad():
        pm(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def run_case(name, case, out):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    cfg = make_config(case["config"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             experts_implementation="eager").float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in pname:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif pname.endswith("experts.gate_up_proj"):
                p.copy_(1.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    rows = make_rows(torch.Generator().manual_seed(1 + sum(map(ord, name))), cfg.vocab_size)
    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **case["lora"])
    stress_routing(model, lcfg, g, rows[:2], cfg.num_local_experts)
    model_dir = os.path.join(d, "model")
    model.save_pretrained(model_dir, safe_serialization=True)

    pm = with_adapter(model, lcfg, g)
    pm.save_pretrained(os.path.join(d, "init_adapter"))
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    pad = cfg.pad_token_id

    pm = pm.double()
    lora_params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]

    def fwd(rs):
        ids, labels = batch_of(rs, pad)
        return ids, pm(input_ids=ids, labels=labels)

    ids, res = fwd(rows[:2])
    per_layer = counts(pm, ids, cfg.num_local_experts)
    clamps = clamp_share(pm, ids)
    print(f"  {name}: tokens per expert per layer {per_layer}", flush=True)
    print(f"  {name}: share clamped (gate, up) per expert {clamps}", flush=True)
    assert stressed(per_layer), per_layer
    assert any(c[0] > 0 for c in clamps) and any(c[1] > 0 for c in clamps), clamps
    res.loss.backward()
    out_t = first_step(res, pm, lora_params)
    losses = adamw_steps(lambda rs: fwd(rs)[1].loss, rows, lora_params)
    save_golden(d, out_t, lora_params, losses)
    meta = dict(case=name, model_dir="model", lora=case["lora"], opt=OPT, pad_id=pad,
                loss=out_t["loss"].item(), train_losses=losses, experts_per_layer=per_layer,
                versions=versions())
    write_meta(d, meta)


if __name__ == "__main__":
    run_cases(CASES, run_case)
