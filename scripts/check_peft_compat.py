#!/usr/bin/env python3
"""Do PEFT and transformers read what lora-train writes, and compute what we compute?

Run from the repository root where torch, transformers and peft are installed (the device
machine; no Rust needed there):

    python3 scripts/check_peft_compat.py

It reads tests/fixtures/compat/ (made by `LORA_TRAIN_REGEN_COMPAT=1 cargo test --test it
compat`): an adapter lora-train trained on the tiny model we ship (recipes/assets/tiny-llama),
lora-train's merged checkpoint of it (3 safetensors shards + index), token ids, and lora-train's
f32 CPU logits for those ids, with the adapter (`logits`) and from the merged checkpoint
(`logits_merged`). Then, in float32 on the CPU:

  1. PeftModel.from_pretrained(base, adapter)       logits  vs our `logits`
  2. AutoModelForCausalLM.from_pretrained(merged)   logits  vs our `logits_merged` and `logits`
  3. PEFT's own merge_and_unload() weights          vs our merged shards, tensor by tensor

Pass: |ours - theirs| <= ATOL + RTOL * |theirs| everywhere, with ATOL = 1e-5, RTOL = 1e-4 for
logits (they are O(1) here) and ATOL = 1e-6, RTOL = 1e-5 for weights. Exit code 0 when every
check passes, 1 otherwise; each line prints the largest absolute and relative differences.
"""
import argparse
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGITS_TOL = (1e-5, 1e-4)  # atol, rtol
WEIGHT_TOL = (1e-6, 1e-5)


def load(path):
    kw = dict(attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    return model.float().eval()


def compare(name, ours, theirs, tol, failures, quiet=False):
    atol, rtol = tol
    ours, theirs = ours.double(), theirs.double()
    if ours.shape != theirs.shape:
        print(f"FAIL {name}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}")
        failures.append(name)
        return
    diff = (ours - theirs).abs()
    rel = diff / theirs.abs().clamp_min(1e-30)
    ok = bool((diff <= atol + rtol * theirs.abs()).all()) and bool(torch.isfinite(ours).all())
    if not (ok and quiet):
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {diff.max().item():.3e}, "
              f"max rel {rel.max().item():.3e} (atol {atol:g}, rtol {rtol:g})")
    if not ok:
        failures.append(name)
    return diff.max().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default=os.path.join(ROOT, "tests/fixtures/compat"))
    ap.add_argument("--base", default=os.path.join(ROOT, "recipes/assets/tiny-llama"))
    args = ap.parse_args()
    torch.manual_seed(0)
    import peft
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")

    ref = load_file(os.path.join(args.fixture, "logits.safetensors"))
    ids = ref["input_ids"].long()
    mask = torch.ones_like(ids)
    adapter_dir = os.path.join(args.fixture, "adapter")
    merged_dir = os.path.join(args.fixture, "merged")
    failures = []

    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(load(args.base), adapter_dir).eval()
        lp = peft_model(input_ids=ids, attention_mask=mask).logits
        compare("PeftModel.from_pretrained(base, adapter) logits vs ours", ref["logits"], lp,
                LOGITS_TOL, failures)

        merged = load(merged_dir)
        lm = merged(input_ids=ids, attention_mask=mask).logits
        compare("from_pretrained(our merged dir) logits vs ours (merged)", ref["logits_merged"],
                lm, LOGITS_TOL, failures)
        compare("from_pretrained(our merged dir) logits vs ours (adapter)", ref["logits"], lm,
                LOGITS_TOL, failures)

        # PEFT's merge against ours, weight by weight (the base is fresh: PEFT merges in place).
        theirs = PeftModel.from_pretrained(load(args.base), adapter_dir).merge_and_unload()
        theirs = {k: v.detach() for k, v in theirs.named_parameters()}
        ours = {}
        for f in sorted(os.listdir(merged_dir)):
            if f.endswith(".safetensors"):
                ours.update(load_file(os.path.join(merged_dir, f)))
        missing = sorted(set(theirs) - set(ours))
        extra = sorted(set(ours) - set(theirs))
        if missing or extra:
            print(f"FAIL merged tensor names: missing {missing}, extra {extra}")
            failures.append("names")
        worst, before = (0.0, ""), len(failures)
        for name in sorted(set(ours) & set(theirs)):
            d = compare(f"weight {name}", ours[name], theirs[name], WEIGHT_TOL, failures, True)
            worst = max(worst, (d, name))
        tag = "ok  " if len(failures) == before else "FAIL"
        print(f"{tag} merged weights vs PEFT merge_and_unload: {len(ours)} tensors, largest "
              f"|diff| {worst[0]:.3e} ({worst[1]})")

    if failures:
        print(f"\n{len(failures)} check(s) FAILED")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
