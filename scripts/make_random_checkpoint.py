#!/usr/bin/env python3
"""A random checkpoint of a named shape, saved as transformers saves a real one (config.json,
bf16 safetensors in 5 GB shards with their index), and rows of random token ids, so that the
`train` command a user runs (and a peer that loads from disk, scripts/bench_unsloth.py) is timed
at full size where no Hub model can be downloaded:

  python3 scripts/make_random_checkpoint.py /tmp/llama2-7b llama2-7b --seq 2048 --rows 400
  python3 scripts/make_random_checkpoint.py /tmp/llama3-8b llama3-8b --rows 0 --tokenizer
  python3 scripts/make_random_checkpoint.py /tmp/tiny tiny --layers 1 --rows 0 --tokenizer  # CPU

Weights are N(0, 0.02) as transformers initialises a fresh model (norms 1), made on the GPU when
there is one (~30 s for 7B). data.jsonl holds `--rows` rows of `--seq` ids ({"input_ids": [...]},
lora-train's format = "tokens"; none with --rows 0). --tokenizer also writes a fast tokenizer of
the shape's vocabulary (tokenizer.json and tokenizer_config.json: a word-level vocabulary of ids
0 .. vocab-1, token i spelled "t<i>", <unk> <s> </s> <pad> the first four), for loaders that
need one (Unsloth's FastLanguageModel.from_pretrained loads the tokenizer beside the weights).
Any family of scripts/bench_peft.py SHAPES is built with its own transformers class.
"""
import argparse
import json
import random

import torch

from bench_peft import SHAPES, family_classes


def save_tokenizer(out, vocab_size):
    """A word-level fast tokenizer of exactly `vocab_size` ids (the model's embedding rows), with
    bos, eos, unk and pad among them, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", model_max_length=1 << 20)
    fast.save_pretrained(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--tokenizer", action="store_true", help="also write a fast tokenizer of the shape's vocab")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a CPU smoke run)")
    a = p.parse_args()

    family, s = SHAPES[a.shape]
    s = dict(s)
    if a.layers is not None:
        s["num_hidden_layers"] = a.layers
    s["max_position_embeddings"] = max(s.get("max_position_embeddings", 4096), 4096, a.seq)
    Config, ForCausalLM, _ = family_classes(family)
    cfg = Config(**s)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        m = ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(a.out, safe_serialization=True, max_shard_size="5GB")
    del m
    if a.tokenizer:
        save_tokenizer(a.out, s["vocab_size"])
    if a.rows > 0:
        rng = random.Random(0)
        with open(f"{a.out}/data.jsonl", "w") as f:
            for _ in range(a.rows):
                f.write(json.dumps({"input_ids": [rng.randrange(s["vocab_size"]) for _ in range(a.seq)]}) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
