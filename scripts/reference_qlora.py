#!/usr/bin/env python3
"""QLoRA golden references from transformers + PEFT + bitsandbytes (CPU), for lora-train's tests.

Run where torch, transformers, peft and bitsandbytes (>= 0.48, for its CPU 4-bit path) are
installed; no GPU is needed:

    python3 scripts/reference_qlora.py --out tests/fixtures/golden

For each case it writes <out>/<case>/:
  model/           config.json + model.safetensors: the f32 base, random weights made as
                   scripts/reference_peft.py makes them
  model_bnb4/      that base loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quant,
                   compute dtype f32) and written back by save_pretrained: a pre-quantized
                   checkpoint as the Hub's *-bnb-4bit repos hold one (per quantized linear:
                   `weight` packed u8 [n/2, 1], `weight.absmax` u8, `weight.quant_map` f32 [16],
                   `weight.nested_absmax` f32, `weight.nested_quant_map` f32 [256],
                   `weight.quant_state.bitsandbytes__nf4` u8 JSON with shape, blocksizes,
                   dtypes and nested_offset, an f32 written as a decimal; embeddings, norms,
                   biases and the head stay f32; config.json carries quantization_config)
  init_adapter/    PEFT adapter (A as PEFT inits it, B random non-zero) made on the 4-bit model
  train.jsonl      8 rows {"input_ids", "labels"}: 4 steps of micro-batch 2
  golden.safetensors
      logits         [2, T, V]  forward of batch 0 with the init adapter, on model_bnb4
      loss           [1]        transformers' causal-LM loss of that batch
      grad.<key>     dL/d(lora param), key = PEFT's adapter key
      after.<key>    the adapter after 4 AdamW steps over train.jsonl in file order
      train_losses   [4]        loss of each of those steps
      dequant.<module>.weight   f32 [out, in]: bitsandbytes.functional.dequantize_4bit of that
                     Linear4bit's weight and quant_state, the weight the 4-bit model computes
                     with (module = the base model's name, e.g. model.layers.0.mlp.down_proj)
  meta.json        reference_peft.py's fields (same optimiser, schedule, clipping; model_dir
                   "model"), plus "quant_model_dir": "model_bnb4", "quant" and the checks below

Unlike reference_peft.py (float64), the references are computed as QLoRA computes them: in f32
(bnb_4bit_compute_dtype) on the CPU, through bitsandbytes' Linear4bit and PEFT's
lora.bnb.Linear4bit. The script asserts
  - that `dequant.*` equals the weight decoded by hand from model_bnb4's tensors
    (checkpoint_dequant: the file format alone), bit for bit, and that model_bnb4 loads back
    to the same packed weights and quant states;
  - that the same steps on a plain f32 model whose linear weights are the `dequant.*` tensors
    give the same logits, loss, gradients and trained adapter (to f32 rounding; with
    bitsandbytes 0.50.2 they are bit-identical), so the golden is f32 LoRA on the dequantized
    base.
meta.json's "f32_vs_f64" says how far the f32 golden is from the same run in float64
(transformers computes the loss itself in f32 either way), the slack a Rust test needs, and
"vs_full_precision" how far the 4-bit model's logits and loss are from the f32 base's with the
same adapter (so a run on the wrong base cannot pass).

bitsandbytes CPU quirks (0.50.2):
  - on a CPU with AVX512-BF16, Linear4bit.forward in eval mode on an input that needs no grad
    (under no_grad, every linear; else the first layer's q/k/v, fed by frozen embeddings)
    repacks the weight for a fused kernel that computes in bf16 (input and absmax cast to
    bf16): logits move by ~1e-2. Training never takes that path, so the models run in train
    mode here (dropout is 0 everywhere) and the script asserts no weight got repacked.
  - its native CPU dequantize_4bit indexes absmax per row, absmax[row * (in // 64) +
    col // 64], which is wrong when in_features is not a multiple of 64 (quantize_4bit runs
    the blocks over the flattened weight, as CUDA does); so every in_features here is a
    multiple of 64 (asserted), where the two agree.
  - without the `kernels` package it logs "Failed to load CPU gemm_4bit_forward from
    kernels-community" at import: harmless here (only the bf16 inference path above uses it).
"""
import json, os, shutil, sys

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as BF
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, get_cosine_schedule_with_warmup
from peft import LoraConfig, PeftModel, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_peft import ALL7, OPT, batch_of, make_config, make_rows, peft_key, run_cases, versions, write_meta  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    # reference_peft.py's llama_gqa (GQA 4 heads / 2 kv, untied head, all 7 linears) with
    # intermediate 128, so every dimension is a multiple of the NF4 block of 64. Each weight
    # (<= 8192 values, <= 128 blocks) has one partial nested block of 256 absmax values.
    # One layer, not two, to keep the fixtures near 1.4 MB (a second adds ~330 KB).
    "qlora_llama_gqa": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
    # Qwen2: q/k/v bias (f32, not quantized), one kv head, tied head, one layer. intermediate
    # 320: gate/up/down hold 20480 values = 320 blocks, so double quant has a full nested block
    # of 256 absmax values and a partial one of 64. (vocab 64 to keep the fixture small.)
    "qlora_qwen2_bias": dict(
        config=dict(model_type="qwen2", hidden_size=64, intermediate_size=320, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=1, vocab_size=64,
                    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True),
        lora=dict(r=4, lora_alpha=8, target_modules=ALL7, use_rslora=False)),
}

BNB = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
           bnb_4bit_compute_dtype=torch.float32)


def random_base(cfg, g):
    """reference_peft.py's random weights (larger than the default 0.02 so every path matters)."""
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in pname:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def load_f32(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager")


def load_4bit(model_dir, quantize):
    kw = dict(quantization_config=BitsAndBytesConfig(**BNB)) if quantize else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu",
                                                attn_implementation="eager", **kw)


def linear4bit(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def dequantized(model):
    """module name -> the f32 weight its Linear4bit computes with."""
    out = {}
    for n, m in linear4bit(model).items():
        st = m.weight.quant_state
        assert not getattr(st, "packing_format_for_cpu", False), n
        assert st.nested and st.quant_type == "nf4" and st.blocksize == 64, n
        w = BF.dequantize_4bit(m.weight.data, st)
        assert w.dtype == torch.float32 and tuple(w.shape) == (m.out_features, m.in_features), n
        out[n] = w.contiguous()
    return out


def checkpoint_dequant(tensors, module):
    """The f32 weight of `module` decoded by hand from model_bnb4's tensors, as a loader that
    knows only the file format would: blocks of 64 over the flattened weight, two codes a byte
    (high nibble first), absmax = nested_quant_map[absmax u8] * nested_absmax[i // 256] +
    nested_offset (all f32), w = quant_map[code] * absmax."""
    p = module + ".weight"
    qs = json.loads(bytes(tensors[p + ".quant_state.bitsandbytes__nf4"].tolist()).decode())
    assert qs["quant_type"] == "nf4" and qs["blocksize"] == 64 and qs["nested_blocksize"] == 256
    assert qs["dtype"] == "float32" and qs["nested_dtype"] == "float32", qs
    packed = tensors[p].reshape(-1)
    assert packed.dtype == torch.uint8
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).long()
    n = codes.numel()
    assert n == qs["shape"][0] * qs["shape"][1]
    a8 = tensors[p + ".absmax"].long()
    assert a8.numel() == n // 64
    absmax = (tensors[p + ".nested_quant_map"][a8]
              * tensors[p + ".nested_absmax"][torch.arange(a8.numel()) // 256]
              + torch.tensor(qs["nested_offset"], dtype=torch.float32))
    w = tensors[p + ".quant_map"][codes] * absmax[torch.arange(n) // 64]
    return w.reshape(qs["shape"])


def golden_run(pm, rows, pad):
    """reference_peft.py's steps: batch 0 forward/backward, then 4 AdamW steps."""
    pm.train()  # dropout is 0; keeps bitsandbytes off its bf16 CPU inference kernel
    lora_params = [(peft_key(n), p) for n, p in pm.named_parameters() if p.requires_grad]
    assert lora_params and all("lora_" in k for k, _ in lora_params)
    t = {}
    ids, labels = batch_of(rows[:2], pad)
    res = pm(input_ids=ids, labels=labels)
    res.loss.backward()
    t["logits"] = res.logits.detach().clone()
    t["loss"] = res.loss.detach().reshape(1).clone()
    for k, p in lora_params:
        t["grad." + k] = p.grad.detach().clone()
    pm.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW([p for _, p in lora_params], lr=OPT["lr"], betas=tuple(OPT["betas"]),
                            eps=OPT["eps"], weight_decay=OPT["weight_decay"])
    sched = get_cosine_schedule_with_warmup(opt, OPT["warmup_steps"], OPT["steps"])
    losses = []
    for s in range(OPT["steps"]):
        ids, labels = batch_of(rows[2 * s: 2 * s + 2], pad)
        loss = pm(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in lora_params], OPT["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    for k, p in lora_params:
        t["after." + k] = p.detach().clone()
    t["train_losses"] = torch.stack(losses)
    return t


def distance(a, b):
    """name -> (max |a - b|, that over max |b|) over the tensors both hold; plus the worst."""
    d = {}
    for k in b:
        x, y = a[k].double(), b[k].double()
        err = (x - y).abs().max().item()
        d[k] = (err, err / max(y.abs().max().item(), 1e-30))
    worst = max(d, key=lambda k: d[k][1])
    return d, worst


def with_adapter(model, adapter_dir):
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def run_case(name, case, out):
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    cfg = make_config(case["config"])
    # Every linear's in_features a multiple of 64: bitsandbytes' CPU dequantize_4bit (its native
    # cdequantize_blockwise_cpu_nf4_fp32) takes the absmax of element (row, col) to be
    # absmax[row * (in // 64) + col // 64], right only then; quantize_4bit, CUDA and
    # checkpoint_dequant below run the blocks over the flattened weight.
    for lin, n in [("hidden", cfg.hidden_size), ("intermediate", cfg.intermediate_size)]:
        assert n % 64 == 0, (lin, n)

    # the f32 base
    base = random_base(cfg, g)
    model_dir = os.path.join(d, "model")
    base.save_pretrained(model_dir, safe_serialization=True)
    vocab = base.config.vocab_size
    pad = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    del base

    # quantized on load, saved pre-quantized, and loaded again from that
    q1 = load_4bit(model_dir, quantize=True)
    deq1 = dequantized(q1)
    assert len(deq1) == cfg.num_hidden_layers * 7, sorted(deq1)
    bnb_dir = os.path.join(d, "model_bnb4")
    q1.save_pretrained(bnb_dir, safe_serialization=True)
    sd1 = {k: v.clone() for k, v in q1.state_dict().items()}
    del q1
    ckpt = load_file(os.path.join(bnb_dir, "model.safetensors"))
    for n, w in deq1.items():
        assert torch.equal(checkpoint_dequant(ckpt, n), w), f"{n}: bnb's dequant is not the file's"
    q = load_4bit(bnb_dir, quantize=False)
    deq = dequantized(q)
    assert deq.keys() == deq1.keys()
    for n in deq:
        assert torch.equal(deq[n], deq1[n]), f"{n}: dequant differs after the save/load round trip"
    sd = q.state_dict()
    for k, v in sd1.items():
        assert torch.equal(sd[k], v), f"{k} differs after the save/load round trip"
    for n, m in q.named_modules():  # what stayed f32
        if isinstance(m, (torch.nn.Embedding, torch.nn.Linear)) and n not in deq:
            assert m.weight.dtype == torch.float32, n

    # the init adapter, made on the 4-bit model
    lcfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **case["lora"])
    pm = get_peft_model(q, lcfg)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    for pname, p in pm.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, (pname, p.dtype)
    adapter_dir = os.path.join(d, "init_adapter")
    pm.save_pretrained(adapter_dir)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = None  # PEFT writes this machine's path; as reference_peft
    acfg["target_modules"] = sorted(acfg["target_modules"])  # a set: its order varies by run
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
    os.remove(os.path.join(adapter_dir, "README.md"))  # PEFT's model card template

    rows = make_rows(g, vocab)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

    # the golden: PEFT LoRA on the 4-bit model, f32 compute
    gold = golden_run(pm, rows, pad)
    for pname, m in pm.named_modules():  # no Linear4bit took the packed bf16 kernel
        if isinstance(m, bnb.nn.Linear4bit):
            assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False), pname
    del pm, q

    # the same on a plain f32 model whose linear weights are the dequantized ones
    def plain_dequant():
        m = load_f32(model_dir)
        mods = dict(m.named_modules())
        with torch.no_grad():
            for n, w in deq.items():
                assert mods[n].weight.shape == w.shape, n
                mods[n].weight.copy_(w)
        return m
    ref = golden_run(with_adapter(plain_dequant(), adapter_dir), rows, pad)
    dist, worst = distance(gold, ref)
    print(f"  4-bit vs f32 on the dequantized weights: worst {worst} {dist[worst][0]:.3g} "
          f"(rel {dist[worst][1]:.3g}); logits {dist['logits'][0]:.3g}", flush=True)
    # same f32 arithmetic up to the order of reductions: logits/loss/grads to ~1e-6 relative,
    # the trained adapter to Adam's scale-free steps (lr x steps x 1e-5, as tests/it/golden.rs)
    for k, (err, rel) in dist.items():
        lim = OPT["lr"] * OPT["steps"] * 1e-5 if k.startswith("after.") else 1e-5
        assert rel <= lim, f"{name}: 4-bit {k} is not f32 LoRA on the dequantized base: {err} {rel}"

    # the same in float64, for the f32 rounding a Rust test must allow
    ref64 = golden_run(with_adapter(plain_dequant().double(), adapter_dir).double(), rows, pad)
    d64, w64 = distance(gold, ref64)
    print(f"  f32 vs f64: worst {w64} rel {d64[w64][1]:.3g}; logits {d64['logits'][0]:.3g}",
          flush=True)

    # how far the 4-bit base is from the full-precision one (same adapter)
    full = golden_run(with_adapter(load_f32(model_dir), adapter_dir), rows, pad)
    dfull, _ = distance(gold, full)
    fp = dict(load_f32(model_dir).named_parameters())
    werr = max(((deq[n] - fp[n + ".weight"]).abs().max() / fp[n + ".weight"].abs().max()).item()
               for n in deq)
    vs_full = dict(
        logits_max_abs=dfull["logits"][0],
        logits_max_rel=dfull["logits"][1],
        logits_rms=(gold["logits"] - full["logits"]).pow(2).mean().sqrt().item(),
        logits_abs_max=full["logits"].abs().max().item(),
        loss_full_precision=full["loss"].item(),
        loss_4bit=gold["loss"].item(),
        train_losses_full_precision=full["train_losses"].tolist(),
        weight_max_err_over_max=werr)
    print(f"  4-bit vs full precision: logits max |d| {vs_full['logits_max_abs']:.4f} "
          f"(rms {vs_full['logits_rms']:.4f}, |logits| <= {vs_full['logits_abs_max']:.3f}); "
          f"loss {vs_full['loss_4bit']:.6f} vs {vs_full['loss_full_precision']:.6f}; "
          f"weights |dequant - w| <= {werr:.4f} max|w|", flush=True)

    out_t = {k: v.detach().float().contiguous() for k, v in gold.items()}
    out_t["loss"] = out_t["loss"].reshape(1)
    for n, w in deq.items():
        out_t[f"dequant.{n}.weight"] = w
    save_file(out_t, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
    losses = gold["train_losses"].tolist()
    meta = dict(case=name, model_dir="model", quant_model_dir="model_bnb4", lora=case["lora"],
                opt=OPT, pad_id=pad, loss=gold["loss"].item(), train_losses=losses,
                sdpa_vs_eager=None,
                quant=dict(type="nf4", double_quant=True, compute_dtype="float32", blocksize=64,
                           nested_blocksize=256, bnb_version=bnb.__version__,
                           quantized_modules=sorted(deq)),
                compute="float32 (CPU, bitsandbytes Linear4bit + PEFT lora.bnb.Linear4bit)",
                vs_dequant_f32={k: v[1] for k, v in dist.items() if k in ("logits", "loss")}
                | {"worst": [worst, dist[worst][1]]},
                f32_vs_f64={"logits_max_abs": d64["logits"][0], "logits_max_rel": d64["logits"][1],
                            "loss_rel": d64["loss"][1], "worst": [w64, d64[w64][1]],
                            "grad_worst_rel": max(v[1] for k, v in d64.items()
                                                  if k.startswith("grad.")),
                            "after_worst_rel": max(v[1] for k, v in d64.items()
                                                   if k.startswith("after."))},
                vs_full_precision=vs_full,
                versions=versions(bitsandbytes=bnb.__version__))
    write_meta(d, meta)



if __name__ == "__main__":
    run_cases(CASES, run_case)
