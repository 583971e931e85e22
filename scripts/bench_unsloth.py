#!/usr/bin/env python3
"""A peer we measure against: LoRA training with Unsloth, run as an Unsloth user runs it.

`FastLanguageModel.from_pretrained` loads a saved random checkpoint of a named shape
(scripts/make_random_checkpoint.py --tokenizer: config, bf16 safetensors and a tokenizer; made
here in a child process when --model has none), `FastLanguageModel.get_peft_model` adds LoRA
with the rank, alpha, dropout and targets of scripts/bench_peft.py, and the same loop times the
same steps: the same tokens per step (--batch x --seq random ids, labels = inputs), torch's
AdamW at lr 1e-4 over the adapters, the same warm-up and timed window (`timed_unix_s`), the
same FLOP count and the same JSON fields (system "unsloth", or "unsloth+bnb-nf4"):

  python3 scripts/bench_unsloth.py --shape llama2-7b --seq 2048 --batch 2 --rank 16 --targets all
  python3 scripts/bench_unsloth.py --shape llama2-7b --ckpt        # use_gradient_checkpointing="unsloth"
  python3 scripts/bench_unsloth.py --shape llama3-8b --load-in-4bit   # QLoRA: bitsandbytes NF4
  python3 scripts/bench_unsloth.py --shape tiny --layers 1 --seq 16 --batch 1 --steps 1  # CPU smoke

Unsloth's own settings: without --ckpt, use_gradient_checkpointing=False at the load and in
get_peft_model; with it, "unsloth" (its offloaded checkpointing) in both. --load-in-4bit is
`load_in_4bit=True` (Unsloth's NF4 with double quant, bf16 compute); otherwise
`load_in_4bit=False, load_in_16bit=True` (its 16-bit LoRA). Everything else is its default
(offload_embedding "auto", its attention backend: flash-attn, else xformers, else torch's SDPA;
the JSON's attn_backend says which ran). lora_alpha defaults to 2 x rank as bench_peft.py's.

No network: HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE, UNSLOTH_DISABLE_STATISTICS
(its from_pretrained otherwise downloads README files from the Hub as usage statistics) and
HF_HUB_DISABLE_XET are set before Unsloth is imported, and the load passes local_files_only;
offline, Unsloth also skips its model-name mapper refresh (a GitHub fetch) and its Xet probe.
Its compiled modules go to UNSLOTH_COMPILE_LOCATION (default here: /tmp/unsloth_compiled_cache).

Exit status 3: `import unsloth` failed (its traceback on stderr). Needs unsloth and unsloth_zoo (and what they import: trl, datasets, bitsandbytes; on the device
from the wheels scripts/fetch-wheels.sh fetches into .devbuild/unsloth). Unsloth needs a GPU for
its kernels; on a machine without one it loads its CPU backend, which this script also runs (a
smoke run of the arguments and the loop, not a measurement).
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_XET": "1",
    "DO_NOT_TRACK": "1",
    "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",
}
for _k, _v in OFFLINE.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402  (after the environment: torch does not read it, Unsloth does)

from bench_peft import SHAPES, TARGETS, base_linear_params, flops_per_token, gib, lora_targets  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--model", default=None,
                   help="a checkpoint of the shape with a tokenizer (default: /tmp/unsloth-ckpt/<shape>,"
                        " made there by scripts/make_random_checkpoint.py when it has no config.json)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="micro-batch")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout")
    p.add_argument("--rslora", action="store_true", help="use_rslora: scale alpha / sqrt(r)")
    p.add_argument("--targets", default="all", choices=sorted(TARGETS))
    p.add_argument("--ckpt", action="store_true", help='use_gradient_checkpointing="unsloth"')
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: load_in_4bit=True (NF4)")
    p.add_argument("--layers", type=int, default=None,
                   help="override num_hidden_layers of a checkpoint made here (a smoke run on the CPU)")
    p.add_argument("--max-memory", default=None, help="cap, e.g. 80GiB (set_per_process_memory_fraction)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul ceiling for MFU")
    p.add_argument("--json", default=None, help="append the JSON line to this file too")
    p.add_argument("--tag", default=None, help="a label copied into the JSON line")
    a = p.parse_args(argv)
    family = SHAPES[a.shape][0]
    if family == "qwen3_moe" or family == "phi3":
        p.error(f"--shape {a.shape}: this script maps --targets for dense q/k/v/o/gate/up/down models;"
                f" {family} is not mapped here yet")
    if a.steps < 1 or a.warmup < 0 or a.seq < 1 or a.batch < 1:
        p.error("--steps >= 1, --warmup >= 0, --seq >= 1 and --batch >= 1")
    if a.model is None:
        a.model = f"/tmp/unsloth-ckpt/{a.shape}" + (f"-L{a.layers}" if a.layers else "")
    return a


def shape_fields(a):
    """The shape's config fields (with --layers applied), as the checkpoint must have them."""
    s = dict(SHAPES[a.shape][1])
    if a.layers is not None:
        s["num_hidden_layers"] = a.layers
    return s


def ensure_checkpoint(a, s):
    """Make --model with scripts/make_random_checkpoint.py (in a child process, so that nothing
    imports transformers before Unsloth here) unless it holds a config.json; then check that its
    config is the shape's."""
    cfg_path = os.path.join(a.model, "config.json")
    if not os.path.exists(cfg_path):
        cmd = [sys.executable, os.path.join(HERE, "make_random_checkpoint.py"), a.model, a.shape,
               "--seq", str(a.seq), "--rows", "0", "--tokenizer"]
        if a.layers is not None:
            cmd += ["--layers", str(a.layers)]
        print("making", a.model, file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    cfg = json.load(open(cfg_path))
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size"):
        if cfg.get(k) != s[k]:
            raise SystemExit(f"{cfg_path}: {k} = {cfg.get(k)}, but --shape {a.shape} has {s[k]}:"
                             f" name a checkpoint of the shape with --model, or remove this one")
    if not os.path.exists(os.path.join(a.model, "tokenizer_config.json")):
        raise SystemExit(f"{a.model}: no tokenizer_config.json; Unsloth loads the tokenizer beside the"
                         f" weights: make it with scripts/make_random_checkpoint.py --tokenizer")


def attention_backend():
    """Which attention Unsloth's dense (unpacked) path runs: flash_dense, xformers or sdpa."""
    try:
        import unsloth.models  # noqa: F401  (the dispatcher imports from it: load it first)
        from unsloth.utils.attention_dispatch import select_attention_backend
        return str(select_attention_backend())
    except Exception as e:  # an Unsloth without the dispatcher, or the CPU backend
        return f"unknown ({type(e).__name__})"


def build(a, dev):
    """(Unsloth's PEFT model, import seconds) as an Unsloth user builds it."""
    t0 = time.time()
    try:
        import unsloth  # noqa: F401  (first: it patches transformers, peft and trl as they import)
        from unsloth import FastLanguageModel
    except Exception:
        traceback.print_exc()
        print("bench_unsloth.py: import unsloth failed (exit 3)", file=sys.stderr, flush=True)
        sys.exit(3)
    import_s = time.time() - t0

    gc = "unsloth" if a.ckpt else False
    precision = dict(load_in_4bit=True) if a.load_in_4bit else dict(load_in_4bit=False, load_in_16bit=True)
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=a.model, max_seq_length=a.seq, dtype=torch.bfloat16,
        use_gradient_checkpointing=gc, local_files_only=True, **precision)
    modules, _ = lora_targets(SHAPES[a.shape][0], a.targets)
    model = FastLanguageModel.get_peft_model(
        model, r=a.rank, lora_alpha=a.alpha or 2 * a.rank, lora_dropout=a.dropout, bias="none",
        target_modules=list(modules), use_gradient_checkpointing=gc, use_rslora=a.rslora,
        random_state=3407, max_seq_length=a.seq)
    FastLanguageModel.for_training(model)
    return model, import_s


def versions():
    out = {}
    from importlib.metadata import PackageNotFoundError, version
    for name in ("unsloth", "unsloth_zoo", "transformers", "peft", "trl", "bitsandbytes", "xformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main():
    a = args()
    s = shape_fields(a)
    ensure_checkpoint(a, s)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if a.max_memory and cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib(a.max_memory) / total), dev)

    t0 = time.time()
    model, import_s = build(a, dev)
    sync()
    load_s = time.time() - t0 - import_s
    after_load = torch.cuda.memory_allocated(dev) / 2**30 if cuda else 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    h, L = s["hidden_size"], s["num_hidden_layers"]
    n_linear = base_linear_params(s)

    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1234)
    ids = torch.randint(0, s["vocab_size"], (a.batch, a.seq), device=dev, generator=g)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    v = versions()
    res = {"system": "unsloth" + ("+bnb-nf4" if a.load_in_4bit else ""), "torch": torch.__version__,
           "unsloth": v["unsloth"], "unsloth_zoo": v["unsloth_zoo"], "versions": v,
           "mode": "single", "world": 1, "shape": a.shape, "seq": a.seq, "micro_batch": a.batch,
           "lora_rank": a.rank, "targets": a.targets, "ckpt": a.ckpt,
           "gradient_checkpointing": "unsloth" if a.ckpt else False,
           "dropout": a.dropout, "rslora": a.rslora, "tag": a.tag, "attn": "default",
           "attn_impl": getattr(getattr(model, "config", None), "_attn_implementation", None),
           "attn_backend": attention_backend(), "family": SHAPES[a.shape][0], "layers": L,
           "trainable_params": trainable, "experts_impl": None, "base_linear_params": n_linear,
           "model_dir": a.model, "import_s": round(import_s, 2), "load_s": round(load_s, 2),
           "after_load_gib": round(after_load, 2), "max_memory": a.max_memory}
    try:
        for _ in range(a.warmup):
            step()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t1 = time.time()
        for _ in range(a.steps):
            loss = step()
        sync()
        dt = time.time() - t1
    except torch.OutOfMemoryError as e:
        res.update({"oom": True, "error": str(e).splitlines()[0]})
        dt = None
    if dt is not None:
        tps = a.batch * a.seq * a.steps / dt
        fpt = flops_per_token(n_linear, L, h, a.seq, a.ckpt)
        res.update({
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 2) if cuda else None,
            "step_s": round(dt / a.steps, 4), "timed_unix_s": [t1, t1 + dt], "tokens_per_s": round(tps, 1),
            "tokens_per_s_per_gpu": round(tps, 1),
            "mfu": round(tps * fpt / (a.peak_tflops * 1e12), 4),
            "final_loss": round(float(loss.detach()), 4),
        })
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
