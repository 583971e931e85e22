#!/usr/bin/env python3
"""Golden references for preference training (DPO, ORPO, SimPO, KTO) from transformers + PEFT
with TRL 1.x's loss formulas, for lora-train's CPU tests.

Run where torch, transformers, peft and trl are installed (CPU is enough):

    python3 scripts/reference_pref.py                      # every case, golden + TRL cross-check
    python3 scripts/reference_pref.py --case dpo_sigmoid   # one case
    python3 scripts/reference_pref.py --no-trl             # goldens only

Model: the tiny Llama we ship (recipes/assets/tiny-llama). For each case it writes
tests/fixtures/pref/<case>/:
  init_adapter/    PEFT adapter (A kaiming as PEFT inits it, B random non-zero, so the policy at
                   step 0 differs from the reference "adapters off")
  train.jsonl      pre-tokenized rows {"prompt_input_ids", "chosen_input_ids",
                   "rejected_input_ids"} (KTO: {"prompt_input_ids", "completion_input_ids",
                   "label"}), STEPS steps of `micro_batch` rows in file order; no template, no
                   BOS / EOS added
  golden.safetensors
      after.<key>    the adapter after STEPS AdamW steps (PEFT's adapter key)
      train_losses   [STEPS] the loss of each step
  meta.json        settings, per-step loss and TRL's metrics (rewards/chosen, rewards/rejected,
                   rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; ORPO also
                   nll_loss, log_odds_ratio, log_odds_chosen; KTO kl), and per step the
                   sequence-level inputs of the loss (policy / reference completion log-prob
                   sums, completion token counts, ...) with dL/d(each sum) by autograd, for the
                   unit tests of the loss functions; "trl_check": TRL's own trainer on the same
                   fixture (f32 and f64) against this script
and tests/fixtures/pref/tokenize.json: TRL's own dataset preparation (DPOTrainer /
KTOTrainer._prepare_dataset) of string and conversational rows, and DataCollatorForPreference's
truncation, for src/data/preference.rs.

The loss formulas are written out here from TRL 1.16's source (trl/trainer/dpo_trainer.py
_compute_loss; trl/experimental/orpo/orpo_trainer.py odds_ratio_loss / concatenated_forward;
trl/experimental/cpo/cpo_trainer.py cpo_loss with loss_type="simpo"; trl/trainer/kto_trainer.py
_compute_loss), not imported, so that the cross-check against TRL's trainers means something.

The golden runs in float64 on the CPU from the f32 weights (as scripts/reference_peft.py), so it
carries no f32 rounding of its own; meta.json's "f32_vs_f64" says how far the same run in f32
lands (the floor any f32 implementation can be held to).
"""
import argparse, contextlib, json, math, os, shutil, sys, tempfile, types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, PeftModel, get_peft_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "recipes/assets/tiny-llama")
OUT = os.path.join(ROOT, "tests/fixtures/pref")

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)
OPT = dict(lr=2e-2, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, max_grad_norm=0.5,
           schedule="cosine", warmup_steps=1, steps=6)

# objective: dpo | orpo | simpo | kto. reference: "base" (adapters off, TRL's default for a
# fresh PEFT adapter) or "init_adapter" (TRL's "ref" copy of a pretrained adapter).
CASES = {
    "dpo_sigmoid": dict(objective="dpo", loss_type="sigmoid", beta=0.1, micro_batch=2),
    "dpo_ipo": dict(objective="dpo", loss_type="ipo", beta=0.5, micro_batch=2),
    "dpo_hinge": dict(objective="dpo", loss_type="hinge", beta=0.1, micro_batch=2),
    "dpo_ref_init": dict(objective="dpo", loss_type="sigmoid", beta=0.1, micro_batch=2,
                         reference="init_adapter"),
    "orpo": dict(objective="orpo", beta=0.1, micro_batch=2),
    "simpo": dict(objective="simpo", beta=2.0, gamma=0.5, cpo_alpha=0.0, micro_batch=2),
    "kto": dict(objective="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.5,
                micro_batch=4),
}


def peft_key(name):
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> PEFT file key
    return name.replace(".default", "")


# ---------------------------------------------------------------------------------------------
# Data


def make_rows(case, g, vocab):
    """Pre-tokenized rows of varied length: prompts of 2-7 tokens, completions of 1-8."""
    n = OPT["steps"] * case["micro_batch"]
    r = lambda lo, hi: lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))
    ids = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()
    rows = []
    for k in range(n):
        if case["objective"] == "kto":
            # labels mixed within every micro-batch, one batch all desirable but one
            label = [True, False, True, False, True, True][k % 6] if k < 20 else k % 4 != 1
            rows.append({"prompt_input_ids": ids(r(2, 7)), "completion_input_ids": ids(r(1, 8)),
                         "label": label})
        else:
            rows.append({"prompt_input_ids": ids(r(2, 7)), "chosen_input_ids": ids(r(1, 8)),
                         "rejected_input_ids": ids(r(1, 8))})
    return rows


def pad_rows(seqs, masks, pad):
    """Right-padded [R, T] ids, attention mask and completion mask (as TRL's collators)."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), t), dtype=torch.long)
    comp = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        comp[i, :len(s)] = torch.tensor(m)
    return ids, attn, comp


def pair_batch(rows, pad):
    """DataCollatorForPreference: chosen sequences first, then rejected ones."""
    p = [r["prompt_input_ids"] for r in rows]
    seqs = [a + r["chosen_input_ids"] for a, r in zip(p, rows)] + \
           [a + r["rejected_input_ids"] for a, r in zip(p, rows)]
    masks = [[0] * len(a) + [1] * len(r["chosen_input_ids"]) for a, r in zip(p, rows)] + \
            [[0] * len(a) + [1] * len(r["rejected_input_ids"]) for a, r in zip(p, rows)]
    return pad_rows(seqs, masks, pad)


def kto_batch(rows, pad):
    """DataCollatorForUnpairedPreference with KL completions rotated by one within the batch:
    (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}) (kto_trainer.py add_kl_completion_ids)."""
    p = [r["prompt_input_ids"] for r in rows]
    c = [r["completion_input_ids"] for r in rows]
    kl_c = [c[-1]] + c[:-1]
    main = pad_rows([a + b for a, b in zip(p, c)], [[0] * len(a) + [1] * len(b) for a, b in zip(p, c)], pad)
    kl = pad_rows([a + b for a, b in zip(p, kl_c)], [[0] * len(a) + [1] * len(b) for a, b in zip(p, kl_c)], pad)
    return main, kl, torch.tensor([r["label"] for r in rows])


# ---------------------------------------------------------------------------------------------
# Log-probabilities


def token_logps(model, ids, attn):
    """[R, T-1] log p(ids[:, t+1] | ids[:, :t+1]) (TRL's fused head / selective_log_softmax)."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def masked_sum(lp, mask):
    return (lp * mask[:, 1:]).sum(dim=1)


# ---------------------------------------------------------------------------------------------
# TRL 1.16's losses, written out (see the module docstring for where each comes from)


def dpo_loss(pc, pr, rc, rr, lc, lr, loss_type, beta):
    """dpo_trainer.py _compute_loss, f_divergence_type reverse_kl, one loss_type, no WPO weighting.
    pc / pr: policy chosen / rejected completion log-prob sums; rc / rr the reference's;
    lc / lr completion token counts (completion_mask.sum, used by ipo)."""
    chosen_logratios = pc - rc
    rejected_logratios = pr - rr
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        per_seq = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        per_seq = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        ipo_delta = chosen_logratios / lc.clamp(min=1.0) - rejected_logratios / lr.clamp(min=1.0)
        per_seq = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(loss_type)
    loss = per_seq.mean()
    cr, rj = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    m = {"rewards/chosen": cr.mean(), "rewards/rejected": rj.mean(),
         "rewards/accuracies": (cr > rj).double().mean(), "rewards/margins": (cr - rj).mean(),
         "logps/chosen": pc.detach().mean(), "logps/rejected": pr.detach().mean()}
    return loss, m


def log1mexp(x):
    """log(1 - exp(x)), branch at -ln 2 (orpo_trainer.py log1mexp)."""
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(pc_avg, pr_avg, nll, beta):
    """orpo_trainer.py odds_ratio_loss + get_batch_loss_metrics: pc_avg / pr_avg the mean
    completion log-prob of each sequence (get_batch_logps average_log_prob=True), nll the
    cross-entropy over every non-pad token of the chosen sequences (prompt included)."""
    log_odds = (pc_avg - pr_avg) - (log1mexp(pc_avg) - log1mexp(pr_avg))
    ratio = F.logsigmoid(log_odds)
    losses = beta * ratio
    loss = nll - losses.mean()
    cr, rj = beta * pc_avg.detach(), beta * pr_avg.detach()
    m = {"rewards/chosen": cr.mean(), "rewards/rejected": rj.mean(),
         "rewards/accuracies": (cr > rj).double().mean(), "rewards/margins": (cr - rj).mean(),
         "logps/chosen": pc_avg.detach().mean(), "logps/rejected": pr_avg.detach().mean(),
         "nll_loss": nll.detach(), "log_odds_ratio": ratio.detach().mean(),
         "log_odds_chosen": log_odds.detach().mean()}
    return loss, m


def simpo_loss(pc_avg, pr_avg, nll, beta, gamma, cpo_alpha, label_smoothing=0.0):
    """cpo_trainer.py cpo_loss (loss_type="simpo", alpha 0) + get_batch_loss_metrics; nll the
    cross-entropy over the chosen completion tokens (0 when cpo_alpha is 0)."""
    logits = (pc_avg - pr_avg) - gamma / beta
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    loss = losses.mean() + cpo_alpha * nll
    cr, rj = beta * pc_avg.detach(), beta * pr_avg.detach()
    m = {"rewards/chosen": cr.mean(), "rewards/rejected": rj.mean(),
         "rewards/accuracies": (cr > rj).double().mean(), "rewards/margins": (cr - rj).mean(),
         "logps/chosen": pc_avg.detach().mean(), "logps/rejected": pr_avg.detach().mean(),
         "nll_loss": nll.detach()}
    return loss, m


def kto_loss(pol, ref, label, kl_pol, kl_ref, beta, dw, uw):
    """kto_trainer.py _compute_loss, loss_type "kto": kl the mean of (policy - reference) over the
    mismatched KL pairs, detached, clamped at 0."""
    kl = (kl_pol - kl_ref).mean().detach().clamp(min=0)
    ci = torch.nonzero(label, as_tuple=False).view(-1)
    ri = torch.nonzero(~label, as_tuple=False).view(-1)
    c_lr = pol.index_select(0, ci) - ref.index_select(0, ci)
    r_lr = pol.index_select(0, ri) - ref.index_select(0, ri)
    chosen_losses = 1 - torch.sigmoid(beta * (c_lr - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - r_lr))
    loss = torch.cat((dw * chosen_losses, uw * rejected_losses), 0).nanmean()
    m = {"kl": kl}
    nc, nr = len(ci), len(ri)
    if nc:
        m["rewards/chosen"] = (beta * c_lr.detach()).nansum() / nc
        m["logps/chosen"] = pol.index_select(0, ci).detach().nansum() / nc
    if nr:
        m["rewards/rejected"] = (beta * r_lr.detach()).nansum() / nr
        m["logps/rejected"] = pol.index_select(0, ri).detach().nansum() / nr
    if nc and nr:
        m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
    return loss, m


# ---------------------------------------------------------------------------------------------
# One step


def leaf(x):
    """x as a leaf of its own graph's end: its .grad is dL/dx after backward."""
    x.retain_grad()
    return x


def step_loss(case, pm, ref_fn, rows, pad):
    """The step's loss, metrics and sequence-level record (inputs of the loss and their grads)."""
    obj, beta = case["objective"], case["beta"]
    if obj == "kto":
        (ids, attn, comp), (kids, kattn, kcomp), label = kto_batch(rows, pad)
        with torch.no_grad():
            kl_pol = masked_sum(token_logps(pm, kids, kattn), kcomp)
        kl_ref = ref_fn(kids, kattn, kcomp)
        ref = ref_fn(ids, attn, comp)
        pol = leaf(masked_sum(token_logps(pm, ids, attn), comp))
        loss, m = kto_loss(pol, ref, label, kl_pol, kl_ref, beta, case["desirable_weight"],
                           case["undesirable_weight"])
        rec = dict(policy=pol, reference=ref, label=label, kl_policy=kl_pol, kl_reference=kl_ref,
                   completion_len=comp.sum(1))
        return loss, m, rec, [("policy", pol)]
    ids, attn, comp = pair_batch(rows, pad)
    n = len(rows)
    lp = token_logps(pm, ids, attn)
    sums = masked_sum(lp, comp)
    pc, pr = leaf(sums[:n]), leaf(sums[n:])
    lens = comp.sum(1).double()
    lc, lr = lens[:n], lens[n:]
    rec = dict(policy_chosen=pc, policy_rejected=pr, chosen_len=lc, rejected_len=lr,
               prompt_len=torch.tensor([len(r["prompt_input_ids"]) for r in rows]))
    grads = [("policy_chosen", pc), ("policy_rejected", pr)]
    if obj == "dpo":
        rsums = ref_fn(ids, attn, comp)
        rc, rr = rsums[:n], rsums[n:]
        loss, m = dpo_loss(pc, pr, rc, rr, lc, lr, case["loss_type"], beta)
        rec.update(reference_chosen=rc, reference_rejected=rr)
        return loss, m, rec, grads
    # ORPO / SimPO average the completion log-probs over the scored completion tokens.
    scored = comp[:, 1:].sum(1).double()
    pc_avg, pr_avg = pc / scored[:n], pr / scored[n:]
    if obj == "orpo":
        # nll over every non-pad position of the chosen rows (labels = ids where attn == 1)
        mask = attn[:n, 1:]
        chosen_all = leaf((lp[:n] * mask).sum(1))
        n_tok = mask.sum().double()
        nll = -chosen_all.sum() / n_tok
        loss, m = orpo_loss(pc_avg, pr_avg, nll, beta)
        rec.update(chosen_all=chosen_all, chosen_all_tokens=mask.sum(1), nll_tokens=n_tok.reshape(1))
        # The NLL reaches the completion tokens through chosen_all, not through pc: dL/dpc below
        # is the odds-ratio part, dL/d(chosen_all) = -1/nll_tokens the NLL's.
        return loss, m, rec, grads + [("chosen_all", chosen_all)]
    if obj == "simpo":
        n_tok = comp[:n, 1:].sum().double()
        nll = -pc.sum() / n_tok if case["cpo_alpha"] != 0 else torch.zeros((), dtype=pc.dtype)
        loss, m = simpo_loss(pc_avg, pr_avg, nll, beta, case["gamma"], case["cpo_alpha"])
        return loss, m, rec, grads
    raise ValueError(obj)


def num(x):
    return x.item() if torch.is_tensor(x) else float(x)


def vec(x):
    return [v.item() if isinstance(v, torch.Tensor) else v for v in x.detach().reshape(-1)]


def train(case, d, rows, dtype):
    """STEPS AdamW steps from init_adapter; returns (adapter after, losses, metrics, records)."""
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, os.path.join(d, "init_adapter"), is_trainable=True)
    pm = pm.to(dtype)
    pm.eval()  # no dropout anywhere (lora_dropout is 0 too)
    if case.get("reference") == "init_adapter":
        rbase = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")
        ref_model = PeftModel.from_pretrained(rbase, os.path.join(d, "init_adapter")).to(dtype).eval()
        ref_ctx = contextlib.nullcontext
    else:
        ref_model, ref_ctx = pm, pm.disable_adapter

    def ref_fn(ids, attn, comp):
        """The reference's completion log-prob sums: no graph, adapters off (or the init copy)."""
        with torch.no_grad(), ref_ctx():
            return masked_sum(token_logps(ref_model, ids, attn), comp)

    pad = base.config.pad_token_id
    params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=OPT["lr"], betas=tuple(OPT["betas"]),
                            eps=OPT["eps"], weight_decay=OPT["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, OPT["warmup_steps"], OPT["steps"])
    mb = case["micro_batch"]
    losses, metrics, records = [], [], []
    for s in range(OPT["steps"]):
        loss, m, rec, leaves = step_loss(case, pm, ref_fn, rows[s * mb:(s + 1) * mb], pad)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], OPT["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        metrics.append({k: num(v) for k, v in m.items()})
        r = {k: vec(v) for k, v in rec.items()}
        r["loss"] = loss.item()
        r["grad_norm"] = grad_norm.item()
        for name, t in leaves:
            r["grad_" + name] = vec(t.grad)
        records.append(r)
    after = {k: p.detach().float().clone() for k, p in params}
    return after, losses, metrics, records


# ---------------------------------------------------------------------------------------------
# TRL's own trainers on the same fixture


def trl_run(name, case, d, rows, dtype, use_cpu=True):
    """TRL's DPOTrainer / ORPOTrainer / CPOTrainer / KTOTrainer, 6 steps on `rows`; the only
    override is the data preparation, which reads our pre-tokenized rows (TRL's trainers
    tokenize strings); losses, reference and optimiser are TRL's and transformers'. use_cpu
    False: on the GPU transformers' Trainer picks (scripts/check_trl_pref.py)."""
    import warnings
    from datasets import Dataset
    warnings.filterwarnings("ignore")
    tok = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, attn_implementation="eager")
    obj = case["objective"]
    out = tempfile.mkdtemp()
    common = dict(output_dir=out, per_device_train_batch_size=case["micro_batch"],
                  max_steps=OPT["steps"], learning_rate=OPT["lr"], lr_scheduler_type="cosine",
                  warmup_steps=OPT["warmup_steps"], weight_decay=OPT["weight_decay"],
                  adam_beta1=OPT["betas"][0], adam_beta2=OPT["betas"][1], adam_epsilon=OPT["eps"],
                  max_grad_norm=OPT["max_grad_norm"], optim="adamw_torch", logging_steps=1,
                  report_to=[], save_strategy="no", bf16=False, fp16=False,
                  gradient_checkpointing=False, train_sampling_strategy="sequential",
                  use_cpu=use_cpu, dataloader_num_workers=0, remove_unused_columns=False,
                  max_length=None if obj in ("dpo", "kto") else 10_000, beta=case["beta"],
                  disable_tqdm=True)
    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **LORA)
    init = os.path.join(d, "init_adapter")
    logs = []

    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **kw):
            logs.append(dict(kw.get("logs") or logs_ or {}))

    if obj in ("dpo", "kto"):
        if obj == "dpo":
            from trl import DPOConfig as Cfg, DPOTrainer as Base
            cfg = Cfg(loss_type=[case["loss_type"]], **common)
            ren = {"prompt_input_ids": "prompt_ids", "chosen_input_ids": "chosen_ids",
                   "rejected_input_ids": "rejected_ids"}
        else:
            from trl import KTOConfig as Cfg, KTOTrainer as Base
            cfg = Cfg(desirable_weight=case["desirable_weight"],
                      undesirable_weight=case["undesirable_weight"], **common)
            ren = {"prompt_input_ids": "prompt_ids", "completion_input_ids": "completion_ids"}

        class T(Base):
            def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
                ds = dataset.rename_columns(ren)
                if obj == "kto":  # TRL's KL completions: rotated by one within each batch
                    b = args.per_device_train_batch_size
                    ds = ds.map(lambda e: {"KL_completion_ids": [e["completion_ids"][-1]] + e["completion_ids"][:-1]},
                                batched=True, batch_size=b)
                return ds

        if case.get("reference") == "init_adapter":
            model = PeftModel.from_pretrained(base, init, is_trainable=True)
            kw = {}
        else:
            model, kw = base, {"peft_config": lcfg}
        tr = T(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
               callbacks=[Keep()], **kw)
        if kw:  # a fresh adapter: load the init adapter's weights into it; the reference stays the base
            from safetensors.torch import load_file
            w = load_file(os.path.join(init, "adapter_model.safetensors"))
            with torch.no_grad():
                for n, p in tr.model.named_parameters():
                    if "lora_" in n:
                        p.copy_(w[peft_key(n)].to(p.dtype))
    else:
        if obj == "orpo":
            from trl.experimental.orpo import ORPOConfig as Cfg, ORPOTrainer as Base
            cfg = Cfg(**common)
        else:
            from trl.experimental.cpo import CPOConfig as Cfg, CPOTrainer as Base
            cfg = Cfg(loss_type="simpo", simpo_gamma=case["gamma"], cpo_alpha=case["cpo_alpha"], **common)

        class T(Base):
            def tokenize_row(self, feature, model=None):
                p = feature["prompt_input_ids"]
                b = {"prompt_input_ids": p, "prompt_attention_mask": [1] * len(p)}
                for k in ("chosen", "rejected"):
                    ids = p + feature[f"{k}_input_ids"]
                    b[f"{k}_input_ids"] = ids
                    b[f"{k}_attention_mask"] = [1] * len(ids)
                    b[f"{k}_labels"] = [-100] * len(p) + feature[f"{k}_input_ids"]
                return b

        data = [dict(r, prompt="p", chosen="c", rejected="r") for r in rows]
        tr = T(model=base, args=cfg, train_dataset=Dataset.from_list(data), processing_class=tok,
               peft_config=lcfg, callbacks=[Keep()])
        from safetensors.torch import load_file
        w = load_file(os.path.join(init, "adapter_model.safetensors"))
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if "lora_" in n:
                    p.copy_(w[peft_key(n)].to(p.dtype))
    tr.train()
    after = {peft_key(n): p.detach().float().clone() for n, p in tr.model.named_parameters()
             if ".default." in n}
    shutil.rmtree(out, ignore_errors=True)
    steps = [l for l in logs if "loss" in l]
    return after, steps


def max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def trl_check(name, case, d, rows, golden, golden32, losses, metrics):
    """TRL's trainer in f32 and f64 against this script's f64 golden (and its f32 run)."""
    res = {}
    for dt, label in ((torch.float32, "f32"), (torch.float64, "f64")):
        after, steps = trl_run(name, case, d, rows, dt)
        worst = 0.0
        for s, m in zip(steps, metrics):
            for k, v in m.items():
                if k in s:
                    worst = max(worst, abs(s[k] - v))
        res[label] = dict(
            adapter_max_abs_diff=max_diff(after, golden),
            adapter_max_abs_diff_vs_script_f32=max_diff(after, golden32),
            loss_max_abs_diff=max(abs(s["loss"] - l) for s, l in zip(steps, losses)),
            metric_max_abs_diff=worst, steps_logged=len(steps),
            metrics_compared=sorted(set(steps[0]) & set(metrics[0])) if steps else [])
        print(f"  TRL {label}: adapter {res[label]['adapter_max_abs_diff']:.2e} "
              f"loss {res[label]['loss_max_abs_diff']:.2e} metrics {worst:.2e}", flush=True)
    import trl
    res["trl"] = trl.__version__
    res["note"] = ("TRL's trainer, the data preparation overridden to read the pre-tokenized rows; "
                   "adapter diffs against this script's f64 golden and its f32 run. TRL's fused "
                   "LM head (trl/kernels/chunked_logprob.py) computes log-probs in f32 even for an "
                   "f64 model, so its 'f64' run still carries f32 log-prob rounding")
    return res


# ---------------------------------------------------------------------------------------------


def run_case(name, case, out, with_trl):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")
    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **LORA)
    pm = get_peft_model(base, lcfg)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(os.path.join(d, "init_adapter"))
    # PEFT's model card is no part of the fixture (the SFT goldens have none either)
    card = os.path.join(d, "init_adapter", "README.md")
    if os.path.exists(card):
        os.remove(card)
    rows = make_rows(case, g, base.config.vocab_size)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

    after, losses, metrics, records = train(case, d, rows, torch.float64)
    after32, losses32, _, _ = train(case, d, rows, torch.float32)
    t = {"after." + k: v.contiguous() for k, v in after.items()}
    t["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    save_file(t, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
    meta = dict(case=name, model_dir="../../../../recipes/assets/tiny-llama", lora=LORA,
                opt=dict(OPT, micro_batch=case["micro_batch"]), pad_id=base.config.pad_token_id,
                objective={k: v for k, v in case.items() if k != "micro_batch"},
                train_losses=losses, metrics=metrics, steps=records,
                f32_vs_f64=dict(adapter_max_abs_diff=max_diff(after32, after),
                                loss_max_abs_diff=max(abs(a - b) for a, b in zip(losses32, losses))),
                versions=versions())
    print(f"{name}: losses {['%.5f' % l for l in losses]} f32 vs f64 adapter "
          f"{meta['f32_vs_f64']['adapter_max_abs_diff']:.2e}", flush=True)
    if with_trl:
        meta["trl_check"] = trl_check(name, case, d, rows, after, after32, losses, metrics)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def versions():
    import trl, transformers, peft
    return dict(torch=torch.__version__, transformers=transformers.__version__,
                peft=peft.__version__, trl=trl.__version__)


# ---------------------------------------------------------------------------------------------
# Tokenization: TRL's own dataset preparation


TOKENIZE_GROUPS = {
    # DPO, strings: EOS appended to chosen / rejected unless already there.
    "dpo_text": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "Hello", "chosen": " world</s>", "rejected": " there, friend"},
        {"prompt": "Count: one two", "chosen": " three four five six seven eight nine ten",
         "rejected": " three"},
    ],
    # DPO, implicit prompt in strings: the common prefix (a trailing space stays with the answer).
    "dpo_text_implicit": [
        {"chosen": "Question: 2+2? Answer: 4", "rejected": "Question: 2+2? Answer: 5"},
        {"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the hat."},
    ],
    # DPO, conversations with an explicit prompt.
    "dpo_chat": [
        {"prompt": [{"role": "user", "content": "What color is the sky?"}],
         "chosen": [{"role": "assistant", "content": "It is blue."}],
         "rejected": [{"role": "assistant", "content": "It is green."}]},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a fruit."}],
         "chosen": [{"role": "assistant", "content": "Apple."}],
         "rejected": [{"role": "assistant", "content": "A car, which is not a fruit at all."}]},
    ],
    # DPO, implicit prompt: whole conversations sharing a prefix.
    "dpo_chat_implicit": [
        {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]},
        {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}],
         "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "7"}]},
    ],
    # KTO, strings and conversations.
    "kto_text": [
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": "The grass is", "completion": " purple.", "label": False},
        {"prompt": "Hello", "completion": " world</s>", "label": True},
    ],
    "kto_chat": [
        {"prompt": [{"role": "user", "content": "What color is the sky?"}],
         "completion": [{"role": "assistant", "content": "It is blue."}], "label": True},
        {"prompt": [{"role": "user", "content": "What color is grass?"}],
         "completion": [{"role": "assistant", "content": "Purple."}], "label": False},
    ],
}


def tokenize_fixture(out):
    """TRL's DPOTrainer / KTOTrainer._prepare_dataset on TOKENIZE_GROUPS (called unbound with the
    few attributes they read), and DataCollatorForPreference's keep_start truncation."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    tok = AutoTokenizer.from_pretrained(MODEL)
    groups = {}
    for gname, rows in TOKENIZE_GROUPS.items():
        if gname.startswith("dpo"):
            fake = types.SimpleNamespace(_tokenizer=tok)
            args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], max_length=None, use_cpu=True, bf16=False)
            ds = DPOTrainer._prepare_dataset(fake, Dataset.from_list(rows), tok, args, "train")
            keys = ("prompt_ids", "chosen_ids", "rejected_ids")
        else:
            fake = types.SimpleNamespace(_tokenizer=tok, calculate_KL=False, desirable_weight=1.0,
                                         undesirable_weight=1.0)
            args = KTOConfig(output_dir=tempfile.mkdtemp(), report_to=[], max_length=None, use_cpu=True, bf16=False)
            ds = KTOTrainer._prepare_dataset(fake, Dataset.from_list(rows), tok, args, "train")
            keys = ("prompt_ids", "completion_ids")
        groups[gname] = dict(rows=rows, expected=[{k: e[k] for k in keys} for e in ds])
    # Truncation: the collator cuts prompt + completion to max_length (keep_start); prepare drops
    # the rows whose prompt alone reaches it.
    examples = groups["dpo_text"]["expected"] + groups["dpo_chat"]["expected"]
    trunc = []
    for max_length in (8, 12, 20, 50, 70):
        kept = [e for e in examples if len(e["prompt_ids"]) < max_length]
        col = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_length)(kept)
        n = len(kept)
        seqs = []
        for i in range(2 * n):
            m = col["attention_mask"][i].bool()
            seqs.append(dict(input_ids=col["input_ids"][i][m].tolist(),
                             completion_mask=col["completion_mask"][i][m].tolist()))
        trunc.append(dict(max_length=max_length,
                          dropped=[i for i, e in enumerate(examples) if len(e["prompt_ids"]) >= max_length],
                          chosen=seqs[:n], rejected=seqs[n:]))
    fixture = dict(
        tokenizer="recipes/assets/tiny-llama", groups=groups,
        truncation=dict(examples="dpo_text then dpo_chat expected", cases=trunc),
        versions=versions(),
        made_by="scripts/reference_pref.py (tokenize_fixture)")
    with open(os.path.join(out, "tokenize.json"), "w") as f:
        json.dump(fixture, f, indent=1)
    print("tokenize.json:", {k: len(v["expected"]) for k, v in groups.items()}, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--case", action="append")
    ap.add_argument("--no-trl", action="store_true", help="skip the cross-check with TRL's trainers")
    ap.add_argument("--no-tokenize", action="store_true", help="skip tokenize.json")
    ap.add_argument("--only-tokenize", action="store_true", help="only tokenize.json")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    os.makedirs(a.out, exist_ok=True)
    failed = []
    for name, case in CASES.items():
        if (a.case and name not in a.case) or a.only_tokenize:
            continue
        try:
            run_case(name, case, a.out, not a.no_trl)
        except Exception:
            import traceback
            traceback.print_exc()
            failed.append(name)
    if not a.no_tokenize and not a.case:
        tokenize_fixture(a.out)
    if failed:
        sys.exit(f"failed cases: {failed}")


if __name__ == "__main__":
    main()
