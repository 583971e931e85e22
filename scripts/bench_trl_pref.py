"""scripts/bench_peft.py --objective dpo: the preference peer, TRL's DPOTrainer with PEFT, timed as
bench_peft.py times SFT (the same random model of a named shape, LoRA rank / alpha / targets /
dropout, warm-up steps then timed steps, the same JSON fields) and as `lora-train bench
--objective dpo` lays the work out:

  python3 scripts/bench_peft.py --objective dpo --shape llama2-7b --seq 1024 --prompt-len 512 --batch 4
  python3 scripts/bench_peft.py --objective dpo ... --ckpt        # DPOConfig's default checkpointing
  python3 scripts/bench_peft.py --objective dpo ... --liger       # + Liger's fused linear DPO loss
  python3 scripts/bench_peft.py --objective dpo --shape tiny --layers 1 --seq 32 --prompt-len 8 \
      --batch 2 --steps 1 --warmup 1                                   # CPU smoke

A pair: a random prompt of --prompt-len ids and two random completions of --seq - --prompt-len
ids each (as `lora-train bench`: --seq tokens a sequence, --batch pairs a micro-batch), given
pre-tokenized (prompt_ids / chosen_ids / rejected_ids: TRL's dataset preparation is skipped, no
EOS added, nothing truncated: max_length None). TRL's settings, each pinned: loss_type
["sigmoid"], beta 0.1, reference = the same PEFT model with its adapters disabled (TRL's default
for a fresh adapter: ref_model None; ours pref_reference = "base"), precompute_ref_log_probs
False, padding_free False, per_device_train_batch_size --batch, bf16 mixed precision on a bf16
model, lr 1e-4 constant, no clipping (--max-grad-norm), gradient_checkpointing only with --ckpt
(DPOConfig's default is True: --ckpt is what a TRL user gets without setting it), dropout off
(disable_dropout and lora_dropout --dropout), the default optimiser of transformers' Trainer.
TRL computes the policy's and the reference's completion log-probs with its fused, chunked LM
head (trl/kernels: no [N, V] logits).

--liger: TRL 1.16 has no Liger DPO loss of its own. Its `use_liger_kernel=True` applies only
Liger's layer kernels (RMSNorm, RoPE, SwiGLU) with fused_linear_cross_entropy forced off
(trl/trainer/dpo_trainer.py, "Liger's fused linear cross-entropy replaces model.forward ... only
its layer kernels are applied"), and keeps TRL's fused LM head. So --liger sets
use_liger_kernel=True AND replaces DPOTrainer._compute_loss with Liger-Kernel's
LigerFusedLinearDPOLoss (liger_kernel.chunked_loss: the lm_head matmul, log-softmax and DPO loss
fused over chunks of the batch, on the policy's and the reference's final hidden states), as
TRL 0.x's `use_liger_loss=True` did: "TRL + PEFT + Liger's fused DPO loss". (On a machine
without a GPU, a smoke run, Liger's Triton layer kernels cannot run: only the fused loss is used,
uncompiled; the JSON's liger_layers says whether the layer kernels ran.)

Timing: a TrainerCallback at the end of step --warmup synchronises, resets the peak and starts
the clock; at the end of step --warmup + --steps it synchronises and stops it. The FLOPs count a
pair's two sequences' training step and the reference's forward of both (as `lora-train bench
--objective dpo` counts them).
"""
import json
import os
import sys
import tempfile
import time

import torch


def _tokenizer(vocab):
    """A word-level fast tokenizer of the shape's vocabulary (TRL reads its pad and eos ids)."""
    from make_random_checkpoint import save_tokenizer
    from transformers import AutoTokenizer
    d = tempfile.mkdtemp()
    save_tokenizer(d, vocab)
    return AutoTokenizer.from_pretrained(d)


def _rows(n, p, c, vocab, seed=1234):
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(4, vocab, (k,), generator=g).tolist()
    return [{"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(c)} for _ in range(n)]


def liger_dpo_compute_loss(beta, compiled):
    """DPOTrainer._compute_loss with Liger-Kernel's fused linear DPO loss: the decoder's final
    hidden states of the [chosen; rejected] rows (policy with graph, reference with the adapters
    disabled and no graph), then LigerFusedLinearDPOLoss over lm_head.weight and the completion
    labels (prompt and padding ignored), summed log-probs (average_log_prob False: TRL's sigmoid
    DPO)."""
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    loss_fn = LigerFusedLinearDPOLoss(ignore_index=-100, beta=beta, use_ref_model=True,
                                      average_log_prob=False, loss_type="sigmoid", compiled=compiled)

    def _compute_loss(self, model, inputs, return_outputs):
        ids, attn = inputs["input_ids"], inputs["attention_mask"]
        labels = ids.masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        peft = self.accelerator.unwrap_model(model)
        lm = peft.get_base_model()
        decoder, head = lm.get_decoder(), lm.get_output_embeddings()
        h = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]
        with torch.no_grad(), peft.disable_adapter():
            rh = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]
        out = loss_fn(head.weight, h, labels, bias=head.bias, ref_input=rh, ref_weight=head.weight,
                      ref_bias=head.bias)
        loss = out[0] if isinstance(out, tuple) else out
        return (loss, None) if return_outputs else loss

    return _compute_loss


def run(a, build_model, dims_of, flops_per_token, base_linear_params):
    """One JSON line for TRL's DPOTrainer at `a`'s shape (see the module docstring)."""
    import warnings
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer
    import trl, transformers, peft as peft_mod
    warnings.filterwarnings("ignore", category=FutureWarning)
    if a.objective != "dpo":
        raise SystemExit(f"--objective {a.objective}: this peer times TRL's DPOTrainer (dpo) only")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    p = max(1, min(a.prompt_len, a.seq - 1))
    c = a.seq - p
    t0 = time.time()
    model, s, modules = build_model(a, dev)
    h, L = s["hidden_size"], s["num_hidden_layers"]
    n_linear = base_linear_params(s)
    tok = _tokenizer(s["vocab_size"])
    total = a.warmup + a.steps
    data = Dataset.from_list(_rows(total * a.batch, p, c, s["vocab_size"]))
    out = tempfile.mkdtemp()
    cfg = DPOConfig(
        output_dir=out, per_device_train_batch_size=a.batch, max_steps=total, learning_rate=1e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=a.max_grad_norm, logging_steps=10**6, report_to=[], save_strategy="no",
        bf16=cuda, fp16=False, gradient_checkpointing=a.ckpt,
        gradient_checkpointing_kwargs={"use_reentrant": False} if a.ckpt else None,
        use_cpu=not cuda, dataloader_num_workers=0, remove_unused_columns=False, max_length=None,
        loss_type=["sigmoid"], beta=0.1, precompute_ref_log_probs=False, padding_free=False,
        disable_dropout=True, use_liger_kernel=a.liger and cuda, disable_tqdm=True, seed=0)
    lcfg = LoraConfig(r=a.rank, lora_alpha=a.alpha or 2 * a.rank, lora_dropout=a.dropout,
                      use_rslora=a.rslora, target_modules=modules, task_type="CAUSAL_LM")
    clock = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (a.warmup, total):
                sync()
                clock[state.global_step] = time.time()
                if state.global_step == a.warmup and cuda:
                    torch.cuda.reset_peak_memory_stats(dev)

    class Trainer(DPOTrainer):
        # the rows are pre-tokenized: TRL's preparation (prompt extraction, EOS, tokenizing) skipped
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    if a.liger:
        Trainer._compute_loss = liger_dpo_compute_loss(0.1, compiled=cuda)
    tr = Trainer(model=model, args=cfg, train_dataset=data, processing_class=tok, peft_config=lcfg,
                 callbacks=[Clock()])
    trainable = sum(q.numel() for q in tr.model.parameters() if q.requires_grad)
    attn_impl = tr.model.config._attn_implementation
    sync()
    load_s = time.time() - t0
    after_load = torch.cuda.memory_allocated(dev) / 2**30 if cuda else 0.0
    res = {"system": "trl+peft" + ("+liger-dpo" if a.liger else ""), "objective": "dpo",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft_mod.__version__, "trl": trl.__version__, "mode": "single", "world": 1,
           "shape": a.shape, "seq": a.seq, "prompt_len": p, "micro_batch": a.batch,
           "lora_rank": a.rank, "targets": a.targets, "ckpt": a.ckpt, "dropout": a.dropout,
           "rslora": a.rslora, "tag": a.tag, "attn_impl": attn_impl, "layers": L,
           "trainable_params": trainable, "base_linear_params": n_linear,
           "load_s": round(load_s, 2), "after_load_gib": round(after_load, 2),
           "max_grad_norm": a.max_grad_norm, "liger_layers": bool(cfg.use_liger_kernel)}
    try:
        result = tr.train()
        dt = clock[total] - clock[a.warmup] if a.steps > 0 else None
    except torch.OutOfMemoryError as e:
        res.update({"oom": True, "error": str(e).splitlines()[0]})
        dt, result = None, None
    if dt:
        pairs = a.batch * a.steps / dt
        tps = 2 * a.seq * pairs
        # the pair's training step plus the reference's forward of both sequences
        fwd = flops_per_token(n_linear, L, h, a.seq, True) - flops_per_token(n_linear, L, h, a.seq, False)
        fpt = flops_per_token(n_linear, L, h, a.seq, a.ckpt) + fwd
        res.update({
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 2) if cuda else None,
            "step_s": round(dt / a.steps, 4), "timed_unix_s": [clock[a.warmup], clock[total]],
            "pairs_per_s": round(pairs, 3), "tokens_per_s": round(tps, 1),
            "tokens_per_s_per_gpu": round(tps, 1),
            "mfu": round(tps * fpt / (a.peak_tflops * 1e12), 4),
            "train_loss": round(float(result.training_loss), 4),
        })
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0
