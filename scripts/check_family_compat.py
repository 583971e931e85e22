#!/usr/bin/env python3
"""Does PEFT load the adapter lora-train saved for a model family, and compute what we compute?

Run where torch, transformers and peft are installed (the device machine; no Rust needed):

    python3 scripts/check_family_compat.py --fixture tests/fixtures/golden/gemma2_softcap \\
        --adapter /tmp/fam/gemma2_softcap/out --metrics /tmp/fam/gemma2_softcap/out/metrics.jsonl \\
        --generated /tmp/fam/gemma2_softcap/generated.txt --merged /tmp/fam/gemma2_softcap/merged

A fixture is a directory of tests/fixtures/golden (scripts/reference_peft.py wrote it): model/
(the transformers checkpoint), init_adapter/, train.jsonl (token rows {"input_ids", "labels"}),
golden.safetensors and meta.json. The base model/ is loaded in float32 on the CPU with eager
attention (Gemma 2's soft-capped attention needs it: sdpa drops the cap), the adapter with
PeftModel.from_pretrained, and then, for what was given:

  load       every tensor of adapter_model.safetensors is in the PEFT model, equal, and every
             LoRA parameter of the PEFT model came from the file (none left at its init)
  --logits   a safetensors file of `input_ids` [B, T] (i64) and our `logits` [B, T, V] (f32):
             PEFT's logits for those ids vs ours
  --golden   the fixture's golden logits (batch 0 = rows 0-1 of train.jsonl, right-padded
             with meta.json's pad_id, with init_adapter) vs PEFT's for --adapter: checks this
             script and the fixture; passes only for the init adapter
  --metrics  our metrics.jsonl: its last eval_loss (lora-train's forward with the saved
             adapter, data.eval = the fixture's train.jsonl) vs PEFT's mean token
             cross-entropy over the same rows (shifted labels, -100 ignored)
  --generated  our greedy new token ids (`lora-train generate --prompt-ids <row 0's first
             --prompt-len ids> --ignore-eos`, one line of ids) vs PEFT's greedy continuation,
             teacher-forced: at each step our token must be PEFT's argmax, or within --margin
             of its logit
  --merged   our `lora-train export` of the adapter: from_pretrained(merged) logits vs PEFT's
             on the rows of train.jsonl

Pass: |ours - theirs| <= ATOL + RTOL * |theirs| everywhere (--atol, --rtol: defaults 1e-4,
1e-4, for an f32 CUDA run of ours against this f32 CPU one). Exit code 0 when every check
passes, 1 otherwise; each check prints its largest absolute and relative differences.
"""
import argparse
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load_base(path):
    kw = dict(attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kw)
    return model.float().eval()


class Checks:
    def __init__(self, atol, rtol):
        self.atol, self.rtol, self.failures, self.done = atol, rtol, [], 0

    def result(self, name, ok, msg):
        self.done += 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {msg}", flush=True)
        if not ok:
            self.failures.append(name)

    def close(self, name, ours, theirs, atol=None, rtol=None):
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        # float64 from the start: a Python float through as_tensor's default float32 would
        # round both sides to the same f32 and hide any difference below its step
        ours = torch.as_tensor(ours, dtype=torch.float64)
        theirs = torch.as_tensor(theirs, dtype=torch.float64)
        if ours.shape != theirs.shape:
            return self.result(name, False, f"shape {tuple(ours.shape)} vs {tuple(theirs.shape)}")
        diff = (ours - theirs).abs()
        rel = diff / theirs.abs().clamp_min(1e-30)
        ok = bool((diff <= atol + rtol * theirs.abs()).all()) and bool(torch.isfinite(ours).all())
        self.result(name, ok, f"max |diff| {diff.max().item():.3e}, max rel {rel.max().item():.3e}"
                              f" (atol {atol:g}, rtol {rtol:g})")


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def padded(rows, pad):
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
    return ids


def ce_sum(model, row):
    """Summed next-token cross-entropy of one row (labels shifted, -100 ignored) and its count."""
    ids = torch.tensor([row["input_ids"]])
    labels = torch.tensor(row.get("labels", row["input_ids"]))
    logits = model(input_ids=ids).logits[0, :-1].double()
    target = labels[1:]
    keep = target != -100
    ce = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    return ce.item(), int(keep.sum())


def check_load(c, pm, adapter):
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    mine = {n.replace(".default", ""): p.detach() for n, p in pm.named_parameters()
            if "lora_" in n}
    missing = sorted(set(saved) - set(mine))
    unloaded = sorted(set(mine) - set(saved))
    if missing or unloaded:
        c.result("adapter tensors vs PEFT model", False,
                 f"in the file, not in the model: {missing[:4]}; in the model, not in the file: "
                 f"{unloaded[:4]} ({len(missing)} / {len(unloaded)})")
        return
    worst = max((mine[k].double() - saved[k].double()).abs().max().item() for k in saved)
    c.result("adapter tensors vs PEFT model", worst == 0.0,
             f"{len(saved)} tensors, all targets {sorted({k.split('.')[-3] for k in saved})}, "
             f"largest |diff| {worst:.3e}")


def check_generated(c, pm, rows, path, prompt_len, margin):
    with open(path) as f:
        ours = [int(x) for x in f.read().replace(",", " ").split()]
    if not ours:
        return c.result("greedy ids vs PEFT", False, f"{path} holds no token ids")
    ids = list(rows[0]["input_ids"][:prompt_len])
    worst, first_bad = 0.0, None
    # With PEFT's KV cache, one token a forward after the prompt, as generate() runs: LongRoPE
    # rotates each forward's tokens by that forward's reach, so a forward over the whole
    # prefix at each step is not what generation computes.
    out = pm(input_ids=torch.tensor([ids]), use_cache=True)
    for k, tok in enumerate(ours):
        logits = out.logits[0, -1].double()
        gap = (logits.max() - logits[tok]).item()
        worst = max(worst, gap)
        if gap > margin and first_bad is None:
            first_bad = (k, tok, int(logits.argmax()))
        # teacher-forced on our ids: one slip does not fail the rest
        out = pm(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values,
                 use_cache=True)
    msg = f"{len(ours)} new tokens, largest (PEFT max logit - logit of our token) {worst:.3e}"
    if first_bad:
        msg += f"; first off at step {first_bad[0]}: ours {first_bad[1]}, PEFT's {first_bad[2]}"
    c.result("greedy ids vs PEFT", first_bad is None, msg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", required=True, help="a tests/fixtures/golden/<case> directory")
    ap.add_argument("--adapter", default=None, help="our adapter directory (default: init_adapter)")
    ap.add_argument("--logits", default=None, help="safetensors with input_ids and our logits")
    ap.add_argument("--golden", action="store_true", help="the fixture's golden batch-0 logits")
    ap.add_argument("--metrics", default=None, help="our metrics.jsonl (last eval_loss)")
    ap.add_argument("--generated", default=None, help="our greedy new ids, one line")
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--margin", type=float, default=1e-4, help="logit slack for greedy ties")
    ap.add_argument("--merged", default=None, help="our `lora-train export` directory")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()
    import peft
    import transformers
    fx = a.fixture.rstrip("/")
    meta = json.load(open(os.path.join(fx, "meta.json")))
    case = meta.get("case", os.path.basename(fx))
    adapter = a.adapter or os.path.join(fx, "init_adapter")
    rows = rows_of(os.path.join(fx, "train.jsonl"))
    pad = meta.get("pad_id", 0)
    print(f"== {case}: adapter {adapter} (torch {torch.__version__}, transformers "
          f"{transformers.__version__}, peft {peft.__version__})", flush=True)
    c = Checks(a.atol, a.rtol)
    torch.manual_seed(0)
    with torch.no_grad():
        base = load_base(os.path.join(fx, meta.get("model_dir", "model")))
        print(f"   {type(base).__name__}, attention {base.config._attn_implementation}", flush=True)
        pm = PeftModel.from_pretrained(base, adapter).eval()
        check_load(c, pm, adapter)
        if a.golden:
            want = load_file(os.path.join(fx, "golden.safetensors"))["logits"]
            got = pm(input_ids=padded(rows[:2], pad)).logits
            c.close(f"{case} PEFT logits vs the fixture's golden (batch 0)", got, want)
        if a.logits:
            ours = load_file(a.logits)
            got = pm(input_ids=ours["input_ids"].long()).logits
            c.close(f"{case} PEFT logits vs ours ({a.logits})", ours["logits"], got)
        if a.metrics:
            evals = [json.loads(line).get("eval_loss") for line in open(a.metrics) if line.strip()]
            evals = [e for e in evals if e is not None]
            s, n = 0.0, 0
            for r in rows:
                ds, dn = ce_sum(pm, r)
                s, n = s + ds, n + dn
            if not evals:
                c.result(f"{case} eval loss vs PEFT", False, f"{a.metrics} has no eval_loss row")
            else:
                c.close(f"{case} our eval loss {evals[-1]!r} (saved adapter) vs PEFT's "
                        f"{s / n!r}, {n} tokens", evals[-1], s / n)
        if a.generated:
            check_generated(c, pm, rows, a.generated, a.prompt_len, a.margin)
        if a.merged:
            ids = padded(rows, pad)
            lp = pm(input_ids=ids).logits
            lm = load_base(a.merged)(input_ids=ids).logits
            c.close(f"{case} from_pretrained(our merged) logits vs PEFT's", lm, lp)
    if c.done <= 1 and not c.failures:
        print("only the load was checked: give --logits, --metrics, --generated or --merged")
    if c.failures:
        print(f"{case}: {len(c.failures)} check(s) FAILED")
        return 1
    print(f"{case}: all {c.done} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
