#!/usr/bin/env python3
"""Golden references for the MoE family (Qwen3-MoE) from transformers + PEFT, in float64.

A sibling of scripts/reference_peft.py (same helpers, same layout of <out>/<case>/, same
optimiser); what differs is the model and the adapter:

  - experts stored fused, as transformers 5 saves them: mlp.experts.gate_up_proj [E, 2I, C],
    mlp.experts.down_proj [E, C, I], the router mlp.gate.weight [E, C];
  - LoRA on the attention's linears (target_modules) and on the experts' fused parameters
    (PEFT's target_parameters: one A [E·r, in] and one B [out, r·E] per parameter);
  - the experts' eager forward (grouped_mm has no float64);
  - the routers drawn so that routing is stressed: in batch 0 each layer leaves one or two
    experts without a token and routes some to every other (`stress_routing`, checked);
  - `qwen3_moe_aux`: the router's load-balancing loss on (output_router_logits, coef 0.05),
    with the attention mask so padding rows do not count, as the HF Trainer passes it.

    python3 scripts/reference_moe.py --out tests/fixtures/golden
"""
import copy, json, os, shutil, sys

import torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import OPT, ROOT, adamw_steps, batch_of, first_step, make_config, make_rows, peft_key, run_cases, save_golden, versions, write_meta  # noqa: E402

BASE = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

CASES = {
    # 8 experts, top-2, renormalised; LoRA on attention and both expert parameters.
    "qwen3_moe": dict(config=BASE, lora=dict(r=4, lora_alpha=8, target_modules=ATTN,
                                             target_parameters=EXPERTS, use_rslora=False)),
    # The same with the load-balancing loss (coef 0.05), top-k not renormalised, and LoRA on
    # q, v and gate_up only.
    "qwen3_moe_aux": dict(config=dict(BASE, norm_topk_prob=False, router_aux_loss_coef=0.05,
                                      output_router_logits=True),
                          aux=True,
                          lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj"],
                                    use_rslora=False)),
}


def counts(pm, ids, n_exp, k):
    """Tokens routed to each expert, per layer, for batch `ids` (a forward hook on the router)."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, i, o: got.append(
        torch.bincount(o[2].reshape(-1), minlength=n_exp).tolist()))
        for n, m in pm.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        pm(input_ids=ids)
    for h in hooks:
        h.remove()
    return got


def with_adapter(model, lcfg, g):
    """PEFT's model over `model`: A as PEFT inits it, B random non-zero (from `g`)."""
    pm = get_peft_model(model, lcfg)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return pm


def stress_routing(model, lcfg, g, rows, n_exp, k):
    """Redraws the routers (wide logits, N(0, 0.5²)) until, in batch 0 under the init adapter
    (made on a copy, from a copy of `g`'s state), each layer leaves one or two experts without
    a token and routes some to every other."""
    routers = [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]
    ids, _ = batch_of(rows, 0)
    state = g.get_state()
    for attempt in range(1000):
        gen = torch.Generator().manual_seed(1000 + attempt)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in routers:
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        g.set_state(state)
        torch.manual_seed(0)  # PEFT's kaiming init of A draws from the global stream
        probe = with_adapter(copy.deepcopy(model), lcfg, g).double()
        per_layer = counts(probe, ids, n_exp, k)
        if all(0 < sum(n == 0 for n in c) <= 2 for c in per_layer):
            g.set_state(state)
            torch.manual_seed(0)
            return
    raise SystemExit("no router draw stresses routing")


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
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    rows = make_rows(torch.Generator().manual_seed(1 + sum(map(ord, name))), cfg.vocab_size)
    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **case["lora"])
    stress_routing(model, lcfg, g, rows[:2], cfg.num_experts, cfg.num_experts_per_tok)
    model_dir = os.path.join(d, "model")
    model.save_pretrained(model_dir, safe_serialization=True)

    pm = with_adapter(model, lcfg, g)
    pm.save_pretrained(os.path.join(d, "init_adapter"))

    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    aux = case.get("aux", False)

    pm = pm.double()
    lora_params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]

    def fwd(rs):
        ids, labels = batch_of(rs, pad)
        kw = {}
        if aux:  # rows' real tokens 1, padding 0 (right padding: logits of real rows unchanged)
            kw["attention_mask"] = (torch.arange(ids.shape[1])[None, :] <
                                    torch.tensor([len(r["input_ids"]) for r in rs])[:, None]).long()
        return ids, pm(input_ids=ids, labels=labels, **kw)

    ids, res = fwd(rows[:2])
    per_layer = counts(pm, ids, cfg.num_experts, cfg.num_experts_per_tok)
    print(f"  {name}: tokens per expert per layer {per_layer}", flush=True)
    assert all(0 < sum(n == 0 for n in c) <= 2 for c in per_layer), per_layer
    res.loss.backward()
    out_t = first_step(res, pm, lora_params)
    if aux:
        out_t["aux_loss"] = res.aux_loss.detach().float().reshape(1)
    losses = adamw_steps(lambda rs: fwd(rs)[1].loss, rows, lora_params)
    save_golden(d, out_t, lora_params, losses)
    meta = dict(case=name, model_dir="model", lora=case["lora"], opt=OPT, pad_id=pad,
                loss=out_t["loss"].item(), train_losses=losses, experts_per_layer=per_layer,
                router_aux_loss_coef=cfg.router_aux_loss_coef if aux else None,
                aux_loss=out_t["aux_loss"].item() if aux else None,
                versions=versions())
    write_meta(d, meta)



if __name__ == "__main__":
    run_cases(CASES, run_case)
