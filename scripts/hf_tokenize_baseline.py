#!/usr/bin/env python3
"""The peer of `lora-train prepare` for issue 69: an Alpaca jsonl tokenized the way a TRL / PEFT
user does it, HF `datasets.map(batched=True, num_proc=N)` with the model's fast tokenizer, timed.

    python3 scripts/hf_tokenize_baseline.py --model recipes/assets/tiny-llama \
        --data /tmp/big-alpaca.jsonl --num-proc 16 --seq-len 256

Each row becomes the Alpaca prompt (alpaca-lora's, as lora-train writes it) + output + EOS,
tokenized and truncated to seq_len, with the prompt's tokens masked (labels -100), as
lora-train's train_on = "completions". Prints one JSON line: rows, MB, seconds, rows/s, MB/s,
tokens. The `datasets` cache is kept out of the timing's way (a fresh cache directory per run).
"""

import argparse
import json
import os
import tempfile
import time

PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-proc", type=int, default=os.cpu_count())
    ap.add_argument("--seq-len", type=int, default=2048)
    a = ap.parse_args()

    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    eos = tok.eos_token or ""
    seq = a.seq_len

    def encode(batch):
        prompts = [
            (PROMPT_INPUT if inp else PROMPT).format(instruction=ins, input=inp)
            for ins, inp in zip(batch["instruction"], batch["input"])
        ]
        full = tok([p + o + eos for p, o in zip(prompts, batch["output"])], truncation=True, max_length=seq,
                   return_offsets_mapping=True)
        labels = []
        for ids, offs, p in zip(full["input_ids"], full["offset_mapping"], prompts):
            labels.append([t if e > len(p) else -100 for t, (_, e) in zip(ids, offs)])
        return {"input_ids": full["input_ids"], "labels": labels}

    size = os.path.getsize(a.data)
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.time()
        ds = datasets.load_dataset("json", data_files=a.data, split="train", cache_dir=cache)
        t_load = time.time() - t0
        out = ds.map(encode, batched=True, num_proc=a.num_proc, remove_columns=ds.column_names)
        secs = time.time() - t0
        tokens = sum(len(x) for x in out["input_ids"])
    print(json.dumps({
        "rows": len(out), "mb": size / 1e6, "seconds": round(secs, 2), "load_seconds": round(t_load, 2),
        "rows_per_s": round(len(out) / secs), "mb_per_s": round(size / 1e6 / secs, 2),
        "tokens": tokens, "num_proc": a.num_proc,
    }))


if __name__ == "__main__":
    main()
