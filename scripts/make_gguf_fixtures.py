#!/usr/bin/env python3
"""References for the GGUF export tests (tests/it/gguf.rs), made with llama.cpp's own
converters and read back with gguf-py (llama.cpp's reader):

  python3 scripts/make_gguf_fixtures.py LLAMA_CPP_DIR LORA_TRAIN_BIN

LLAMA_CPP_DIR is a llama.cpp checkout (convert_hf_to_gguf.py, convert_lora_to_gguf.py,
gguf-py; llama-cpp-python's sdist vendors one); needs torch, transformers, numpy,
sentencepiece, tokenizers. Writes tests/fixtures/gguf/:

- tok128/ (a 128-token byte-level BPE tokenizer), spm128/ (a 128-piece SentencePiece model):
  tokenizers for the golden family checkpoints, which ship none;
- tiny_adapter/: the adapter trained by recipes/tiny-cpu.toml (PEFT files);
- tiny_<outtype>.json: convert_hf_to_gguf.py --outtype <outtype> of the tiny Llama merged with
  that adapter (`lora-train export`, safetensors), as a digest;
- tiny_lora_<outtype>.json: convert_lora_to_gguf.py of the adapter;
- family_<case>.json: convert_hf_to_gguf.py --outtype f16 of each golden case's base with its
  tokenizer;
- k256_<type>.json: llama-quantize (no importance matrix) of lora-train's f16 GGUF of a llama
  checkpoint whose rows are multiples of 256 (`k256_checkpoint`, weights from an integer
  formula that the Rust test repeats): llama.cpp's own type mix and, per quantized tensor, the
  relative L2 error of its blocks against the f16 values.

A digest holds every metadata key (GGUF value type, value) and every tensor (ggml type, shape
as ggml counts it, sha256 of its bytes). convert_hf_to_gguf.py refuses a BPE tokenizer whose
pre-tokenizer hash it does not know (ours are made here); for those the script answers
"gpt-2" when the pre-tokenizer is a plain ByteLevel one, which is what lora-train does.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

LCPP = Path(sys.argv[1]).resolve()
BIN = Path(sys.argv[2]).resolve()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/gguf"
sys.path.insert(0, str(LCPP / "gguf-py"))
import gguf  # noqa: E402

PATCH = """
import sys, json
sys.path.insert(0, {lcpp!r})
sys.path.insert(0, {gguf_py!r})
import conversion.base as base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        t = json.load(open(self.dir_model / "tokenizer.json"))["pre_tokenizer"]
        if t.get("type") == "ByteLevel" and t.get("use_regex", True):
            return "gpt-2"
        raise
base.TextModel.get_vocab_base_pre = pre
sys.argv = [{script!r}] + {args!r}
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def run_converter(script, args):
    code = PATCH.format(lcpp=str(LCPP), gguf_py=str(LCPP / "gguf-py"), script=str(LCPP / script), args=args)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=LCPP)


def value(field):
    t = field.types
    if t[0] == gguf.GGUFValueType.ARRAY:
        sub = t[-1]
        vals = [field.contents(i) for i in range(len(field.data))] if sub == gguf.GGUFValueType.STRING else field.contents()
        return [int(sub)], vals
    return [int(t[0])], field.contents()


def digest(path):
    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        types, v = value(f)
        if isinstance(v, float):
            v = float(np.float32(v)) if types[0] == int(gguf.GGUFValueType.FLOAT32) else v
        meta[k] = {"type": int(f.types[0]), "sub": types[0] if f.types[0] == gguf.GGUFValueType.ARRAY else None, "value": v}
    tensors = {}
    for t in r.tensors:
        tensors[t.name] = {
            "type": gguf.GGMLQuantizationType(t.tensor_type).name,
            "shape": [int(x) for x in t.shape],
            "sha256": hashlib.sha256(bytes(np.ascontiguousarray(t.data).view(np.uint8))).hexdigest(),
        }
    return {"metadata": meta, "tensors": tensors}


def save(name, d):
    (OUT / name).write_text(json.dumps(d, indent=0, ensure_ascii=False, sort_keys=True) + "\n")
    print("wrote", OUT / name, (OUT / name).stat().st_size, "bytes")


def tok128(dst):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    chars = sorted(c for c in alphabet if c.isalpha() and c.isascii()) + ["\u0120", ".", ","]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    merges = []
    for a, b in [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("a", "n"), ("e", "r")]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    while len(vocab) < 124:
        vocab[f"<|extra_{len(vocab)}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|user|>"][:3])
    # <|endoftext|>: transformers 5 reads a Qwen checkpoint's tokenizer as Qwen2Tokenizer,
    # which adds it when missing
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.add_tokens(["<extra>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    n = tok.get_vocab_size()
    assert n == 128, n
    cfg = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def spm128(dst):
    import sentencepiece as spm
    dst.mkdir(parents=True, exist_ok=True)
    text = [json.loads(l)["text"] for l in open(ROOT / "recipes/data/tiny-text.jsonl")]
    with tempfile.TemporaryDirectory() as td:
        corpus = Path(td) / "c.txt"
        corpus.write_text("\n".join(text))
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(td) / "m"), vocab_size=128, model_type="bpe",
            character_coverage=1.0, byte_fallback=False, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
            unk_id=3, bos_id=1, eos_id=2, pad_id=0, minloglevel=2, normalization_rule_name="identity",
        )
        shutil.copy(Path(td) / "m.model", dst / "tokenizer.model")
    cfg = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer",
        "added_tokens_decoder": {"4": {"content": "<start_of_turn>", "special": True}, "5": {"content": "<end_of_turn>", "special": True}},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


FAMILIES = {
    "llama_gqa": "tok128", "llama32_tied_long": "tok128", "mistral_head_dim": "spm128",
    "qwen2_bias": "tok128", "qwen3_qk_norm": "tok128", "qwen3_moe": "tok128",
    "gemma2_softcap": "spm128", "gemma3_local_global": "spm128", "phi3_fused_longrope": "spm128",
}


def family_dir(case, tok, td):
    d = Path(td) / case
    shutil.copytree(ROOT / "tests/fixtures/golden" / case / "model", d)
    for f in (OUT / tok).iterdir():
        shutil.copy(f, d / f.name)
    return d


K256 = dict(hidden=256, inter=512, layers=2, heads=4, kv=2, vocab=128)


def k256_tensors():
    """(name, shape) of the k256 checkpoint, in the order of the formula's tensor index."""
    h, i, kvd = K256["hidden"], K256["inter"], K256["kv"] * (K256["hidden"] // K256["heads"])
    out = [("model.embed_tokens.weight", (K256["vocab"], h))]
    for l in range(K256["layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kvd, h)), (p + "self_attn.v_proj.weight", (kvd, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (K256["vocab"], h))]


def k256_checkpoint(d):
    """value = ((i·7919 + t·104729) mod 2001 − 1000) / 8000 for element i of tensor t (f32),
    plus 1 for the norms."""
    from safetensors.numpy import save_file
    d.mkdir(parents=True, exist_ok=True)
    ts = {}
    for t, (name, shape) in enumerate(k256_tensors()):
        n = int(np.prod(shape))
        v = ((np.arange(n, dtype=np.int64) * 7919 + t * 104729) % 2001 - 1000).astype(np.float32) / np.float32(8000)
        if len(shape) == 1:
            v = v + np.float32(1)
        ts[name] = v.reshape(shape)
    save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": K256["hidden"],
           "intermediate_size": K256["inter"], "num_hidden_layers": K256["layers"],
           "num_attention_heads": K256["heads"], "num_key_value_heads": K256["kv"], "vocab_size": K256["vocab"],
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in (OUT / "tok128").iterdir():
        shutil.copy(f, d / f.name)


def k256_quants(td):
    d = td / "k256"
    k256_checkpoint(d)
    f16 = td / "k256-f16.gguf"
    subprocess.run([str(BIN), "export", "--base", str(d), "--format", "gguf", "--out", str(f16)], check=True)
    quantize = LCPP / "build/bin/llama-quantize"
    for q in ["Q4_K_M", "Q5_K_M", "Q6_K"]:
        f = td / f"k256-{q}.gguf"
        subprocess.run([str(quantize), str(f16), str(f), q], check=True, capture_output=True)
        d = digest(f)
        # candle's k-quant blocks are not ggml's (see docs/gguf.md): the test compares errors
        src = {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(f16).tensors}
        for t in gguf.GGUFReader(f).tensors:
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                deq = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(src[t.name].shape)
                err = np.linalg.norm(deq - src[t.name]) / np.linalg.norm(src[t.name])
                d["tensors"][t.name]["rel_err"] = float(err)
        save(f"k256_{q.lower()}.json", d)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tok128(OUT / "tok128")
    spm128(OUT / "spm128")
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        k256_quants(td)
        # the tiny Llama, trained and merged by lora-train
        run_dir = Path(os.environ["TINY_RUN"]) if "TINY_RUN" in os.environ else td / "tiny-run"
        if not (run_dir / "adapter_model.safetensors").is_file():
            subprocess.run([str(BIN), "--recipe", str(ROOT / "recipes/tiny-cpu.toml"), "--set", f"output.dir={run_dir}"], check=True)
        ad = OUT / "tiny_adapter"
        ad.mkdir(exist_ok=True)
        for f in ["adapter_model.safetensors", "adapter_config.json"]:
            shutil.copy(run_dir / f, ad / f)
        merged = td / "tiny-merged"
        subprocess.run([str(BIN), "export", "--adapter", str(ad), "--base", str(ROOT / "recipes/assets/tiny-llama"), "--out", str(merged)], check=True)
        for outtype in ["f16", "bf16", "q8_0", "f32"]:
            f = td / f"tiny-{outtype}.gguf"
            run_converter("convert_hf_to_gguf.py", [str(merged), "--outtype", outtype, "--outfile", str(f)])
            save(f"tiny_{outtype}.json", digest(f))
        for outtype in ["f32", "f16"]:
            f = td / f"tiny-lora-{outtype}.gguf"
            run_converter("convert_lora_to_gguf.py", [str(ad), "--base", str(ROOT / "recipes/assets/tiny-llama"), "--outtype", outtype, "--outfile", str(f)])
            save(f"tiny_lora_{outtype}.json", digest(f))
        for case, tok in FAMILIES.items():
            d = family_dir(case, tok, td)
            f = td / f"{case}.gguf"
            run_converter("convert_hf_to_gguf.py", [str(d), "--outtype", "f16", "--outfile", str(f)])
            save(f"family_{case}.json", digest(f))


if __name__ == "__main__":
    main()
