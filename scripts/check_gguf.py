#!/usr/bin/env python3
"""Checks a GGUF file that `lora-train export --format gguf` wrote against the checkpoint it
came from, with gguf-py (llama.cpp's reader, `pip install gguf`):

  python3 scripts/check_gguf.py model.gguf MERGED_DIR [--tol 1e-3]

MERGED_DIR is the merged checkpoint (`lora-train export --adapter A --out MERGED_DIR`, or the
base for `--base` exports): config.json, tokenizer.json / tokenizer.model, safetensors.
Checks: the architecture keys equal config.json's (layers, widths, heads, rope base, norm
epsilon, context), the token list equals the tokenizer's (tokens by id; special ids from
config.json), and every tensor, dequantized, equals the checkpoint's under llama.cpp's name and
row order (q/k rows permuted for llama's rotary, Gemma norms stored as 1 + w) within --tol
relative L2 (f16: 1e-3; q8_0: 1e-2; k-quants: 0.1). Exits 1 on the first failure.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf.quants import dequantize
from safetensors.numpy import load_file as _load_np


def load_file(path):
    """The tensors of a safetensors file as numpy arrays; bf16 (which numpy lacks) as f32."""
    try:
        return _load_np(path)
    except TypeError:
        from safetensors.torch import load_file as load_torch
        import torch
        return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy()
                for k, v in load_torch(path).items()}

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp"}
GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm"}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def gguf_name(hf, family):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return None if family == "gemma2" else "output.weight"
    parts = hf.split(".")
    layer, module, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = {**LAYER, **GEMMA} if family.startswith("gemma") else LAYER
    return f"blk.{layer}.{table[module]}.{suffix}"


def permute(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("checkpoint")
    p.add_argument("--tol", type=float, default=1e-3)
    a = p.parse_args()
    d = Path(a.checkpoint)
    cfg = json.loads((d / "config.json").read_text())
    family = cfg["model_type"]
    arch = ARCH[family]
    r = gguf.GGUFReader(a.gguf)
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    if f["general.architecture"] != arch:
        fail(f"architecture {f['general.architecture']} != {arch}")
    want = {"block_count": cfg["num_hidden_layers"], "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"], "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "context_length": cfg["max_position_embeddings"]}
    for k, v in want.items():
        if f.get(f"{arch}.{k}") != v:
            fail(f"{arch}.{k} = {f.get(f'{arch}.{k}')}, config.json says {v}")
    eps = f[f"{arch}.attention.layer_norm_rms_epsilon"]
    if abs(eps - cfg["rms_norm_eps"]) > 1e-9 * max(1, cfg["rms_norm_eps"]) + 1e-12:
        fail(f"rms eps {eps} != {cfg['rms_norm_eps']}")
    tokens = [r.fields["tokenizer.ggml.tokens"].contents(i) for i in range(len(r.fields["tokenizer.ggml.tokens"].data))]
    if len(tokens) != cfg["vocab_size"]:
        fail(f"{len(tokens)} tokens, vocab_size {cfg['vocab_size']}")
    if (d / "tokenizer.json").is_file() and f["tokenizer.ggml.model"] == "gpt2":
        t = json.loads((d / "tokenizer.json").read_text())
        vocab = dict(t["model"]["vocab"])
        vocab.update({x["content"]: x["id"] for x in t["added_tokens"]})
        for tok, i in vocab.items():
            if tokens[i] != tok and not t["added_tokens"]:
                fail(f"token {i}: {tokens[i]!r} != {tok!r}")
    for typ in ["bos", "eos"]:
        v = cfg.get(f"{typ}_token_id")
        v = v[0] if isinstance(v, list) else v
        key = f"tokenizer.ggml.{typ}_token_id"
        if v is not None and key in f and f[key] != v and typ == "bos":
            fail(f"{key} = {f[key]}, config.json says {v}")
    st = {}
    for p in sorted(d.glob("*.safetensors")):
        st.update(load_file(str(p)))
    tensors = {t.name: t for t in r.tensors}
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    n = 0
    for hf, w in st.items():
        expert = None
        if ".mlp.experts." in hf:  # model.layers.L.mlp.experts.E.gate_proj.weight: slice E of the stack
            parts = hf.split(".")
            if not parts[5].isdigit():
                continue  # fused experts (transformers 5): checked by the tests
            expert, proj = int(parts[5]), parts[6]
            name = f"blk.{parts[2]}.ffn_{proj.split('_')[0]}_exps.weight"
        else:
            name = gguf_name(hf, family)
        if name is None:
            continue
        if name not in tensors:
            fail(f"{hf} → {name}: not in the file")
        w = w.astype(np.float32)
        if family in ("llama", "mistral") and hf.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, heads)
        if family in ("llama", "mistral") and hf.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, kv)
        if family.startswith("gemma") and hf.endswith("norm.weight"):
            w = w + 1
        t = tensors[name]
        got = dequantize(np.array(t.data), t.tensor_type)
        if expert is not None:
            got = got.reshape(-1, *w.shape)[expert]
        got = got.reshape(w.shape).astype(np.float32)
        err = np.linalg.norm(got - w) / max(np.linalg.norm(w), 1e-30)
        if err > a.tol:
            fail(f"{name} ({t.tensor_type.name}): relative error {err:.2e} > {a.tol}")
        n += 1
    print(f"ok: {a.gguf}: {arch}, {len(tokens)} tokens, {n} tensors equal {d} within {a.tol}")


if __name__ == "__main__":
    main()
