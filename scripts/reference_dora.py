#!/usr/bin/env python3
"""DoRA golden references from transformers + PEFT (CPU), for lora-train's tests.

    python3 scripts/reference_dora.py --out tests/fixtures/golden

Reuses two bases that scripts/reference_peft.py and scripts/reference_qlora.py made (no new
model weights): llama_gqa/model (f32, computed here in float64 as reference_peft.py does) and
qlora_llama_gqa/model_bnb4 (bitsandbytes NF4, double quant, computed in f32 through
Linear4bit, in train mode, as reference_qlora.py does). For each case it writes <out>/<case>/:
  init_adapter/    PEFT DoRA adapter (use_dora: true): A as PEFT inits it, B random non-zero,
                   the magnitude m = ||W||_row as PEFT inits it times (1 + 0.1 N(0, 1)), so
                   m / ||W + s B A|| is away from 1 in every row
  train.jsonl      the base case's 8 rows (copied)
  golden.safetensors
      logits, loss, grad.<key>, after.<key>, train_losses   as reference_peft.py, the keys
                   including PEFT's `base_model.model.<module>.lora_magnitude_vector`
      merged.<module>.weight  [out, in]: the adapted linear after the 4 steps, merged:
                   PEFT's merge_and_unload (f32 base); for the NF4 base (whose PEFT merge
                   quantizes again) (m / ||W + s B A||) (W + s B A) on bitsandbytes'
                   dequantized W, which is what PEFT's merge computes before it re-quantizes
  after_adapter/   the adapter after the 4 steps, saved by PEFT (for load-back tests)
  meta.json        as reference_peft.py (model_dir relative to the case directory)

The script asserts that PEFT loads the saved adapters back to the same tensors.
"""
import json, os, shutil, sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from peft import LoraConfig, PeftModel, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import ALL7, OPT, batch_of, peft_key, run_cases, versions, write_meta  # noqa: E402
from reference_qlora import dequantized, golden_run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAG = "lora_magnitude_vector"

CASES = {
    # llama_gqa's base (GQA, untied, two layers, sharded), all seven linears, float64.
    "dora_llama_gqa": dict(base="llama_gqa", model="model", nf4=False,
                           lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
    # qlora_llama_gqa's bitsandbytes 4-bit checkpoint, f32 compute.
    "dora_qlora_llama_gqa": dict(base="qlora_llama_gqa", model="model_bnb4", nf4=True,
                                 lora=dict(r=4, lora_alpha=8, target_modules=ALL7,
                                           use_rslora=False)),
}


def load(model_dir, nf4):
    kw = dict(device_map="cpu") if nf4 else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager", **kw)


def tidy_config(adapter_dir):
    """As reference_qlora.py: no machine path, a sorted target list, no model card."""
    p = os.path.join(adapter_dir, "adapter_config.json")
    with open(p) as f:
        acfg = json.load(f)
    assert acfg["use_dora"] is True, acfg
    acfg["base_model_name_or_path"] = None
    acfg["target_modules"] = sorted(acfg["target_modules"])
    with open(p, "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
    card = os.path.join(adapter_dir, "README.md")
    if os.path.exists(card):
        os.remove(card)


def dora_merge(w, a, b, m, s):
    """(m / ||W + s B A||_row) (W + s B A), in W's dtype: PEFT's merge_safe."""
    v = w + s * (b @ a)
    return (m / torch.linalg.norm(v, dim=1)).view(-1, 1) * v


def run_case(name, case, out):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    base_dir = os.path.join(out, case["base"])
    model_dir = os.path.join(base_dir, case["model"])
    shutil.copy(os.path.join(base_dir, "train.jsonl"), os.path.join(d, "train.jsonl"))
    with open(os.path.join(d, "train.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    model = load(model_dir, case["nf4"])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_dora=True,
                      **case["lora"])
    pm = get_peft_model(model, lcfg)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "lora_magnitude_vector" in pname:
                p.mul_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    adapter_dir = os.path.join(d, "init_adapter")
    pm.save_pretrained(adapter_dir)
    tidy_config(adapter_dir)
    keys = [peft_key(n) for n, p in pm.named_parameters() if p.requires_grad]
    assert sum(MAG in k for k in keys) == len(keys) // 3, keys

    if not case["nf4"]:
        pm = pm.double()
    # PEFT's file key for m has no `.weight` (its parameter's name has)
    gold = {k.replace(MAG + ".weight", MAG): v for k, v in golden_run(pm, rows, pad).items()}
    scale = case["lora"]["lora_alpha"] / case["lora"]["r"]
    after = {k[len("after."):]: v for k, v in gold.items() if k.startswith("after.")}

    # the trained adapter, saved by PEFT and loaded back by it
    after_dir = os.path.join(d, "after_adapter")
    pm.float().save_pretrained(after_dir)
    tidy_config(after_dir)
    saved = load_file(os.path.join(after_dir, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(after), (sorted(saved), sorted(after))
    for k, v in after.items():
        assert torch.equal(saved[k], v.float()), k
    back = PeftModel.from_pretrained(load(model_dir, case["nf4"]), after_dir)
    for n, p in back.named_parameters():
        if "lora_" in n:
            assert torch.equal(p.detach(), saved[peft_key(n).replace(MAG + ".weight", MAG)]), n

    # merged weights of the adapted linears
    merged = {}
    if case["nf4"]:
        for n, w in dequantized(load(model_dir, True)).items():
            k = f"base_model.model.{n}"
            merged[n] = dora_merge(w, after[k + ".lora_A.weight"], after[k + ".lora_B.weight"],
                                   after[k + ".lora_magnitude_vector"], scale)
    else:
        ref = PeftModel.from_pretrained(load(model_dir, False), after_dir).double()
        plain = dict(ref.merge_and_unload().named_modules())
        for k in after:
            if k.endswith(".lora_A.weight"):
                n = k[len("base_model.model."):-len(".lora_A.weight")]
                merged[n] = plain[n].weight.detach()
        # PEFT's merge is the formula (the test holds ours to the former)
        w0 = dict(load(model_dir, False).double().named_modules())
        for n, w in merged.items():
            k = f"base_model.model.{n}"
            f = dora_merge(w0[n].weight.detach(), saved[k + ".lora_A.weight"].double(),
                           saved[k + ".lora_B.weight"].double(),
                           saved[k + ".lora_magnitude_vector"].double(), scale)
            assert torch.allclose(w, f, rtol=1e-12, atol=1e-12), n

    out_t = {k: v.detach().float().contiguous() for k, v in gold.items()}
    out_t["loss"] = out_t["loss"].reshape(1)
    for n, w in merged.items():
        out_t[f"merged.{n}.weight"] = w.detach().float().contiguous()
    save_file(out_t, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
    losses = gold["train_losses"].tolist()
    rel = os.path.relpath(model_dir, d)
    meta = dict(case=name, model_dir=rel, lora=dict(case["lora"], use_dora=True), opt=OPT,
                pad_id=pad, loss=gold["loss"].item(), train_losses=losses, sdpa_vs_eager=None,
                compute="float32 (bitsandbytes Linear4bit)" if case["nf4"] else "float64",
                versions=versions())
    write_meta(d, meta)



if __name__ == "__main__":
    run_cases(CASES, run_case)
