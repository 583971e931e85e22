#!/usr/bin/env python3
"""How far transformers + PEFT itself lands from the float64 goldens when it runs in bf16.

    python3 scripts/peft_bf16_error.py [--device cuda] [--case qwen3_qk_norm ...] \
        [--json tests/fixtures/golden/peft_bf16_error.json]

For each golden case (tests/fixtures/golden/<case>) it loads the case's model and init adapter
in bf16, runs the reference's first forward/backward and its 4 AdamW steps exactly as
scripts/reference_peft.py does in float64, and prints the relative L2 error of the logits, of
every LoRA gradient and of every trained adapter tensor against golden.safetensors: the worst of
each, and the tensor it came from. That is the yardstick for our own bf16 tolerance (the CUDA
goldens in tests/it/golden.rs): a bf16 run cannot be held closer to f64 than PEFT's own is. --json writes the figures that
test reads (made on one H200), updating the cases it ran and keeping the others.
"""
import argparse, json, os, sys, time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup
from peft import PeftModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import OPT, ROOT, batch_of, peft_key  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests/fixtures/golden")


def rel_l2(got, want):
    got, want = got.double().cpu(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def worst(errs):
    k = max(errs, key=errs.get)
    return errs[k], k


def run_case(case, device):
    d = os.path.join(GOLDEN, case)
    meta = json.load(open(os.path.join(d, "meta.json")))
    want = load_file(os.path.join(d, "golden.safetensors"))
    rows = [json.loads(l) for l in open(os.path.join(d, "train.jsonl"))]
    model = AutoModelForCausalLM.from_pretrained(os.path.normpath(os.path.join(d, meta["model_dir"])),
                                                 dtype=torch.bfloat16, attn_implementation="eager")
    pm = PeftModel.from_pretrained(model, os.path.join(d, "init_adapter"), is_trainable=True)
    pm = pm.to(device=device, dtype=torch.bfloat16)
    pad = meta["pad_id"]
    params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]

    def fwd(rs):
        ids, labels = batch_of(rs, pad)
        kw = {}
        if getattr(model.config, "output_router_logits", False):
            # the router's loss counts real tokens alone, as scripts/reference_moe.py
            kw["attention_mask"] = (torch.arange(ids.shape[1])[None, :] <
                                    torch.tensor([len(r["input_ids"]) for r in rs])[:, None]).long().to(device)
        return pm(input_ids=ids.to(device), labels=labels.to(device), **kw)

    res = fwd(rows[:2])
    res.loss.backward()
    out = {"logits": rel_l2(res.logits.float(), want["logits"]),
           "loss": abs(res.loss.item() - want["loss"].item()) / abs(want["loss"].item())}
    grads = {k: rel_l2(p.grad.float(), want["grad." + k]) for k, p in params}
    pm.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW([p for _, p in params], lr=OPT["lr"], betas=tuple(OPT["betas"]),
                            eps=OPT["eps"], weight_decay=OPT["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, OPT["warmup_steps"], OPT["steps"])
    for s in range(OPT["steps"]):
        fwd(rows[2 * s: 2 * s + 2]).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], OPT["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    after = {k: rel_l2(p.detach().float(), want["after." + k]) for k, p in params}
    g, gk = worst(grads)
    a, ak = worst(after)
    print(f"{case}: logits {out['logits']:.3e}  loss {out['loss']:.3e}  "
          f"grad {g:.3e} ({gk})  trained {a:.3e} ({ak})", flush=True)
    return {"logits": out["logits"], "loss": out["loss"], "grad": g, "trained": a}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", action="append")
    ap.add_argument("--json", help="write {case: worst errors} here (the CUDA goldens' yardstick)")
    a = ap.parse_args()
    cases = a.case or sorted(c for c in os.listdir(GOLDEN)
                             if os.path.exists(os.path.join(GOLDEN, c, "golden.safetensors")))
    errors = {c: run_case(c, a.device) for c in cases}
    if a.json:
        import peft, transformers
        gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        made_by = (f"python3 scripts/peft_bf16_error.py --device {a.device} --json "
                   f"tests/fixtures/golden/peft_bf16_error.json ({gpu}, torch {torch.__version__}, "
                   f"transformers {transformers.__version__}, peft {peft.__version__}), "
                   f"{time.strftime('%Y-%m-%d')}")
        kept = {}  # the cases not run this time stay as they were
        if os.path.exists(a.json):
            kept = json.load(open(a.json)).get("cases", {})
        with open(a.json + ".tmp", "w") as f:
            json.dump({"made_by": made_by, "cases": dict(sorted({**kept, **errors}.items()))}, f,
                      indent=1)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
