#!/usr/bin/env python3
"""gpt-oss with its experts in MXFP4, as the Hub stores them: the fixture of src/quant/mxfp4.rs
and of tests/it/golden.rs's `golden_gpt_oss_mxfp4_*`.

scripts/reference_gpt_oss.py's gpt_oss case with experts of width 32 (MXFP4's blocks of 32
run along each expert's inputs: hidden 32 and intermediate 32) is made in a scratch directory
(its model, initial adapter and rows drawn as there); this writes <out>/gpt_oss_mxfp4/:

  model/         the same model, each layer's mlp.experts.{gate_up,down}_proj quartered and
                 packed to MXFP4
                 as transformers saves gpt-oss (`P_blocks` u8 [E, out, in/32, 16], e2m1 codes
                 two a byte, the low nibble first; `P_scales` u8 [E, out, in/32], e8m0) and
                 config.json's quantization_config {"quant_method": "mxfp4"}. The packing is
                 ours (round to the nearest e2m1 level under the block's exponent
                 floor(log2(absmax)) - 2); what the test holds is transformers' reading of it.
  dequantized.safetensors
                 transformers' dequantized experts (from_pretrained with
                 Mxfp4Config(dequantize=True), its convert_moe_packed_tensors, bf16):
                 `model.layers.{l}.mlp.experts.{gate_up,down}_proj`, [E, in, out].
  bf16/          that dequantized model unquantized (its state dict, config.json without
                 quantization_config), checked to load in transformers with the same logits.
  init_adapter/, train.jsonl
                 the scratch case's.
  golden.safetensors, meta.json
                 PEFT over the dequantized model in float64: batch 0's logits, loss and
                 gradients, then 6 AdamW steps, as scripts/reference_gpt_oss.py.

    python3 scripts/reference_gpt_oss_mxfp4.py --out tests/fixtures/golden
"""
import argparse, json, os, shutil, sys, tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from peft import PeftModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import OPT, adamw_steps, batch_of, first_step, peft_key, save_golden, versions, write_meta  # noqa: E402
from reference_gpt_oss import CASES, run_case  # noqa: E402

OPT["steps"] = 6
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROJ = ["gate_up_proj", "down_proj"]


def pack(w):
    """w [E, in, out] (transformers' x·W layout) -> (blocks u8 [E, out, in/32, 16], scales u8
    [E, out, in/32]): each block of 32 inputs of one output row under one exponent."""
    t = w.double().transpose(1, 2).contiguous()  # [E, out, in]
    e, o, i = t.shape
    t = t.reshape(e, o, i // 32, 32)
    amax = t.abs().amax(-1).clamp_min(2.0 ** -120)
    exp = torch.floor(torch.log2(amax)) - 2  # e2m1's largest exponent is 2 (6 = 1.5 · 2^2)
    x = (t / torch.pow(2.0, exp)[..., None]).clamp(-6, 6)
    mag = (x.abs()[..., None] - E2M1.double()).abs().argmin(-1)  # nearest level, ties low
    code = (mag + 8 * (x < 0).long()).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    scratch = tempfile.mkdtemp()
    case = dict(CASES["gpt_oss"])
    case["config"] = dict(case["config"], intermediate_size=32)
    run_case("gpt_oss_mx", case, scratch)  # the draws' seed: the name's
    src = os.path.join(scratch, "gpt_oss_mx")
    d = os.path.join(a.out, "gpt_oss_mxfp4")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "model"))
    for f in ["init_adapter", "train.jsonl"]:
        (shutil.copytree if os.path.isdir(os.path.join(src, f)) else shutil.copy)(
            os.path.join(src, f), os.path.join(d, f))
    shutil.copy(os.path.join(src, "model", "generation_config.json"), os.path.join(d, "model"))

    base = load_file(os.path.join(src, "model", "model.safetensors"))
    packed = {}
    for k, v in base.items():
        proj = next((p for p in PROJ if k.endswith("mlp.experts." + p)), None)
        if proj is None:
            packed[k] = v
            continue
        # quartered (a power of two: the same codes, each scale two less): the clamped SwiGLU's
        # products stay small enough that f32 holds the residual stream at the golden tolerance
        packed[k + "_blocks"], packed[k + "_scales"] = pack(0.25 * v)
    save_file(packed, os.path.join(d, "model", "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "model", "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    with open(os.path.join(d, "model", "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(d, "model"), quantization_config=Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    deq = {}
    for n, p in model.named_parameters():
        if any(n.endswith("mlp.experts." + p_) for p_ in PROJ):
            assert p.dtype == torch.bfloat16, (n, p.dtype)  # convert_moe_packed_tensors' own
            deq[n] = p.detach().contiguous()
    assert len(deq) == 2 * cfg["num_hidden_layers"], sorted(deq)
    save_file(deq, os.path.join(d, "dequantized.safetensors"), metadata={"format": "pt"})
    model = model.float()  # the dequantized experts come in bf16 whatever dtype says
    err = max((deq[k].float() - 0.25 * base[k]).abs().max().item() for k in deq)
    print(f"  MXFP4 round trip of the f32 experts: max |error| {err:.3g}", flush=True)
    # the unquantized copy: transformers 5.17's save_pretrained of this model writes config.json
    # without quantization_config but leaves the dequantized experts out, so it is written here
    os.makedirs(os.path.join(d, "bf16"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    assert all(k in state for k in deq), "the dequantized experts are in the state dict"
    save_file(state, os.path.join(d, "bf16", "model.safetensors"), metadata={"format": "pt"})
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    with open(os.path.join(d, "bf16", "config.json"), "w") as f:
        json.dump(plain, f, indent=2)
    again = AutoModelForCausalLM.from_pretrained(
        os.path.join(d, "bf16"), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager")
    probe = torch.arange(1, 13)[None]
    with torch.no_grad():
        assert torch.equal(again(input_ids=probe).logits, model(input_ids=probe).logits)

    pm = PeftModel.from_pretrained(model, os.path.join(d, "init_adapter"), is_trainable=True)
    pm = pm.double()
    with open(os.path.join(d, "train.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    with open(os.path.join(src, "meta.json")) as f:
        src_meta = json.load(f)
    pad = src_meta["pad_id"]
    lora_params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]

    def fwd(rs):
        ids, labels = batch_of(rs, pad)
        return pm(input_ids=ids, labels=labels)

    res = fwd(rows[:2])
    res.loss.backward()
    out_t = first_step(res, pm, lora_params)
    losses = adamw_steps(lambda rs: fwd(rs).loss, rows, lora_params)
    save_golden(d, out_t, lora_params, losses)
    meta = dict(case="gpt_oss_mxfp4", model_dir="model", lora=src_meta["lora"], opt=OPT,
                pad_id=pad, loss=out_t["loss"].item(), train_losses=losses,
                mxfp4_round_trip_max_error=err, versions=versions())
    write_meta(d, meta)
    shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
