#!/usr/bin/env python3
"""TRL's own trainers against lora-train's binary: the preference formulas are TRL's, not only
our reading of them (issue 65).

  python3 scripts/check_trl_pref.py target/release/lora-train                 # dpo_sigmoid, orpo, CPU
  python3 scripts/check_trl_pref.py .devbuild/lora-train --device cuda \
      --runner "bash scripts/device-env.sh"                                   # both on the GPU, f32
  python3 scripts/check_trl_pref.py BIN --case dpo_ipo --case kto             # any fixture case

For each case of tests/fixtures/pref (scripts/reference_pref.py made them: the tiny Llama of
recipes/assets/tiny-llama, an init adapter with A as PEFT initialises it and B random non-zero,
pre-tokenized rows {prompt_input_ids, chosen_input_ids, rejected_input_ids} or KTO's
{prompt_input_ids, completion_input_ids, label}):

1. TRL 1.x's own trainer (DPOTrainer with loss_type [case's], ORPOTrainer from trl.experimental,
   CPOTrainer for simpo, KTOTrainer) trains 6 AdamW steps in f32 through
   scripts/reference_pref.py trl_run: a fresh PEFT adapter (peft_config: r 4, alpha 8, all 7
   linears, dropout 0) whose weights are then set to the init adapter's, so the reference stays
   the base model (TRL's default for a fresh adapter; for dpo_ref_init the init adapter is
   loaded as a trainable PeftModel and TRL keeps its "ref" copy). Pinned: the data preparation
   reads the pre-tokenized rows as they are (no EOS added), max_length None (DPO, KTO) or 10000
   (ORPO, SimPO): no truncation; per_device_train_batch_size = the case's micro-batch, sequential
   sampling, lr 2e-2 cosine with 1 warm-up step, AdamW (torch) betas 0.9 / 0.99, eps 1e-8, weight
   decay 0.1, max_grad_norm 0.5, no dropout (disable_dropout, lora_dropout 0), bf16 and fp16 off,
   no gradient checkpointing, eager attention, precompute_ref_log_probs False, padding_free False
   (DPOConfig's defaults, except where the fixture's optimiser says otherwise).
2. The binary (argv[1]) trains the same 6 steps from the same init adapter with the recipe
   tests/it/pref.rs writes (data.format = "preference" / "unpaired_preference",
   train.objective, train.pref_beta, train.micro_batch, data.seq_len 64, the optimiser above,
   model.dtype f32, model.device --device).
3. Prints, per adapter tensor group, the largest |ours - TRL| and the two runs' losses, and exits
   1 when any adapter entry differs by more than --tol (1e-4), or a tensor is missing.

Needs torch, transformers, peft, trl, datasets (scripts/fetch-wheels.sh trl carries trl and
datasets for a machine without them).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference_pref as ref  # noqa: E402

FIX = os.path.join(ref.ROOT, "tests/fixtures/pref")


def recipe(case, meta, out, device):
    """The recipe tests/it/pref.rs pref_recipe writes for `case`, on `device`."""
    d = os.path.join(FIX, case)
    o, obj = meta["opt"], meta["objective"]
    name = obj["objective"]
    train = f'objective = "{name}"\npref_beta = {obj["beta"]}\n'
    if obj.get("loss_type", "sigmoid") != "sigmoid":
        train += f'pref_loss = "{obj["loss_type"]}"\n'
    if obj.get("reference") == "init_adapter":
        train += 'pref_reference = "init_adapter"\n'
    for key, ours in [("gamma", "simpo_gamma"), ("cpo_alpha", "cpo_alpha"),
                      ("desirable_weight", "kto_desirable_weight"),
                      ("undesirable_weight", "kto_undesirable_weight")]:
        if key in obj:
            train += f"{ours} = {obj[key]}\n"
    fmt = "unpaired_preference" if name == "kto" else "preference"
    model = os.path.normpath(os.path.join(d, meta["model_dir"]))
    return f"""
[model]
path = "{model}"
dtype = "f32"
device = "{device}"
[lora]
init_adapter = "{os.path.join(d, 'init_adapter')}"
dropout = 0.0
[data]
train = "{os.path.join(d, 'train.jsonl')}"
format = "{fmt}"
seq_len = 64
shuffle = false
[train]
{train}micro_batch = {o['micro_batch']}
max_steps = {o['steps']}
lr = {o['lr']}
betas = [{o['betas'][0]}, {o['betas'][1]}]
eps = {o['eps']}
weight_decay = {o['weight_decay']}
max_grad_norm = {o['max_grad_norm']}
schedule = "{o['schedule']}"
warmup_steps = {o['warmup_steps']}
[output]
dir = "{out}"
"""


def ours(binary, case, meta, device, runner=()):
    """(adapter tensors, per-step losses) of the binary's run (under `runner`, e.g.
    scripts/device-env.sh, which finds the CUDA libraries)."""
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "out")
    p = os.path.join(tmp, "recipe.toml")
    with open(p, "w") as f:
        f.write(recipe(case, meta, out, device))
    r = subprocess.run([*runner, binary, "--recipe", p], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{case}: {binary} exited {r.returncode}:\n{r.stderr[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return load_file(os.path.join(out, "adapter_model.safetensors")), [r["loss"] for r in rows]


def group(key):
    """q_proj.lora_A ... : the module kind and A / B of an adapter key."""
    parts = key.split(".")
    return ".".join(p for p in parts if p.endswith("_proj") or p.startswith("lora_"))


def check(binary, case, device, tol, runner=()):
    d = os.path.join(FIX, case)
    meta = json.load(open(os.path.join(d, "meta.json")))
    spec = dict(meta["objective"], micro_batch=meta["opt"]["micro_batch"])
    rows = [json.loads(l) for l in open(os.path.join(d, "train.jsonl"))]
    after, steps = ref.trl_run(case, spec, d, rows, torch.float32, use_cpu=device == "cpu")
    got, losses = ours(binary, case, meta, device, runner)
    init = load_file(os.path.join(d, "init_adapter/adapter_model.safetensors"))
    bad = sorted(set(after) ^ set(got))
    worst, by_group, moved = 0.0, {}, 0.0
    for k in sorted(set(after) & set(got)):
        diff = (after[k].double() - got[k].double().to(after[k].device)).abs().max().item()
        worst = max(worst, diff)
        by_group[group(k)] = max(by_group.get(group(k), 0.0), diff)
        moved = max(moved, (after[k].double().cpu() - init[k].double()).abs().max().item())
    trl_losses = [s["loss"] for s in steps]
    print(f"== {case} on {device}: TRL {ref.versions()['trl']} vs {os.path.basename(binary)}")
    print(f"   losses TRL  {['%.6f' % l for l in trl_losses]}")
    print(f"   losses ours {['%.6f' % l for l in losses]}")
    for g, v in sorted(by_group.items()):
        print(f"   {g:24s} max |ours - TRL| {v:.3e}")
    ok = not bad and worst <= tol and len(after) > 0
    print(f"   {case}: adapter max |ours - TRL| {worst:.3e} over {len(after)} tensors "
          f"(moved {moved:.3e} from init; tol {tol:g}): {'PASS' if ok else 'FAIL'}"
          + (f"; keys in one only: {bad[:4]}" if bad else ""), flush=True)
    return dict(case=case, device=device, adapter_max_abs_diff=worst, moved=moved,
                per_group=by_group, trl_losses=trl_losses, our_losses=losses, ok=ok,
                missing=bad)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="the lora-train binary")
    ap.add_argument("--case", action="append", choices=sorted(ref.CASES),
                    help="fixture case (repeatable; default dpo_sigmoid and orpo)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", default=None, help="append each case's result as a JSON line")
    ap.add_argument("--runner", default="",
                    help='a command the binary runs under, e.g. "bash scripts/device-env.sh"')
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner = shlex.split(a.runner)
    results = [check(os.path.abspath(a.binary), c, a.device, a.tol, runner)
               for c in (a.case or ["dpo_sigmoid", "orpo"])]
    if a.json:
        with open(a.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
