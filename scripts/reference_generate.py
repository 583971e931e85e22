#!/usr/bin/env python3
"""Greedy references from transformers' generate() for lora-train's `generate` tests.

    /opt/pyref/bin/python scripts/reference_generate.py   # writes tests/fixtures/generate/expected.json

For every golden checkpoint under tests/fixtures/golden (see scripts/reference_peft.py), alone
and with its PEFT adapter (init_adapter/: A as PEFT inits it, B random and non-zero, saved by
PEFT), it runs `generate(do_sample=False, max_new_tokens=N)` in float32 with eager attention on
a few token-id prompts, and records the new token ids; every family we train has a case (the
families' fixtures with their adapters). Extra cases:
  - mistral_head_dim with sliding_window = 5 (config override), so that prompt and decoding both
    cross the window;
  - one prompt per case whose eos_token_id is set to a token greedy writes later (at one of steps
    1..6, not written before): generate must stop there, the stop token included;
  - the shipped tiny model with text prompts (their token ids recorded as transformers' tokenizer
    makes them: BOS, no EOS).

Each sequence is checked twice before it is written: a float64 forward over prompt + output must
pick the same tokens (the reference is not a float32 rounding artefact), and the smallest gap
between the best and second-best logit over the generated positions (`min_margin`, in float64)
is recorded. A prompt whose margin is under MIN_MARGIN is replaced by another draw, so that a
float32 implementation that sums in another order still picks the same tokens.
"""
import copy, json, os, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests/fixtures")
MAX_NEW = 20
MIN_MARGIN = 1e-3
STOP_AT = 6
DRAWS = 8
# Gemma 2's fixture caps its logits at 2.0: over 128 tokens near-uniform, no draw of 20 new
# tokens keeps every gap above 1e-3. Still 100x our float32 error on capped logits.
CASE_MARGIN = {"gemma2_softcap+adapter": (1e-4, 32)}  # name -> (margin, draws)

CASES = [
    # (name, model dir, adapter dir or None, config overrides)
    ("llama_gqa", "golden/llama_gqa/model", None, {}),
    ("llama_gqa+adapter", "golden/llama_gqa/model", "golden/llama_gqa/init_adapter", {}),
    ("llama_mha_tied_rope3", "golden/llama_mha_tied_rope3/model", None, {}),
    ("llama_mha_tied_rope3+adapter", "golden/llama_mha_tied_rope3/model",
     "golden/llama_mha_tied_rope3/init_adapter", {}),
    ("qwen2_bias", "golden/qwen2_bias/model", None, {}),
    ("qwen2_bias+adapter", "golden/qwen2_bias/model", "golden/qwen2_bias/init_adapter", {}),
    ("mistral_head_dim", "golden/mistral_head_dim/model", None, {}),
    ("mistral_head_dim+adapter", "golden/mistral_head_dim/model",
     "golden/mistral_head_dim/init_adapter", {}),
    ("mistral_window5+adapter", "golden/mistral_head_dim/model",
     "golden/mistral_head_dim/init_adapter", {"sliding_window": 5}),
    ("tiny_shipped+adapter", "../../recipes/assets/tiny-llama", "golden/tiny_shipped/init_adapter",
     {}),
] + [
    # The other families, each with its adapter (appended: the draws above stay as they were).
    (f"{c}+adapter", f"golden/{c}/model", f"golden/{c}/init_adapter", {})
    for c in ["qwen3_qk_norm", "gemma2_softcap", "gemma3_local_global", "phi3_fused_longrope",
              "llama32_tied_long", "qwen3_moe"]
] + [
    # gpt-oss: attention sinks in the decoding attention, sliding and full layers, YaRN, biases
    ("gpt_oss+adapter", "golden/gpt_oss/model", "golden/gpt_oss/init_adapter", {}),
]
# Candidates, in order; the first three whose margin is safe are kept.
TEXT_PROMPTS = ["Once upon a time", "The red fox jumps over", "Seven plus two is",
                "On Friday it was rainy, so", "The dog is white.", "Five times four is",
                "Spell the word \"bear\".", "What color is the dog?", "The young cow looks at",
                "Four plus ten is", "Tom went to the park", "Sort these words"]


def load(model_dir, adapter, overrides, dtype):
    path = os.path.join(FIX, model_dir)
    kw = {}
    if overrides:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(path)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        kw["config"] = cfg
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type", "")
        if "moe" in model_type or model_type == "gpt_oss":
            kw["experts_implementation"] = "eager"  # torch's grouped GEMM takes no float64
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kw)
    if adapter:
        m = PeftModel.from_pretrained(m, os.path.join(FIX, adapter))
        m = m.to(dtype)
    return m.eval()


def greedy(model, ids, eos):
    if longrope(model):
        return cached_greedy(model, ids, eos, MAX_NEW)[0]
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=eos, pad_token_id=0, temperature=None, top_p=None,
                         top_k=None)
    return out[0, len(ids):].tolist()


def longrope(model):
    rp = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling",
                                                                    None) or {}
    return rp.get("rope_type") == "longrope"


def cached_greedy(model, ids, eos, n, forced=None):
    """Greedy through the model's own KV cache, one token a forward after the prompt (or
    `forced`'s tokens, teacher-forced): (new tokens, each step's logits). For LongRoPE, whose
    table follows each forward's reach: the cached keys keep the rotation of the forward that
    wrote them (as vLLM's Phi-3 does). transformers' generate() drops the cache when the
    sequence first passes original_max_position_embeddings, meaning to recompute it, but runs
    only the newest token then: the context before it is lost."""
    new, rows = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for k in range(n):
            row = out.logits[0, -1]
            rows.append(row.double())
            tok = int(row.argmax()) if forced is None else forced[k]
            new.append(tok)
            if tok in (eos or []) or k + 1 == n:
                break
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return new, rows


def margin_check(model64, ids, new):
    """The float64 argmax at each generated position (teacher-forced) and the smallest gap.
    LongRoPE rotates each forward's tokens by that forward's reach, so a pass over the whole
    sequence is not what generation computed: there, the cached forwards, teacher-forced."""
    if longrope(model64):
        return margins(cached_greedy(model64, ids, None, len(new), forced=new)[1])
    full = torch.tensor([ids + new])
    with torch.no_grad():
        logits = model64(input_ids=full).logits[0].double()
    return margins([logits[len(ids) - 1 + i] for i in range(len(new))])


def margins(rows):
    """Each row's argmax, and the smallest gap between a row's best two logits."""
    gaps, picks = [], []
    for row in rows:
        top = torch.topk(row, 2)
        picks.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
    return picks, min(gaps) if gaps else float("inf")


def safe_text(m32, m64, tok, text, eos):
    ids = tok(text).input_ids
    new = greedy(m32, ids, eos or None)
    margin = margin_check(m64, ids, new)[1]
    if margin < MIN_MARGIN:
        print(f"  text prompt {text!r}: margin {margin:.2e}, skipped", flush=True)
    return margin >= MIN_MARGIN


def run_case(name, model_dir, adapter, overrides, gen):
    min_margin, draws = CASE_MARGIN.get(name, (MIN_MARGIN, DRAWS))
    m32 = load(model_dir, adapter, overrides, torch.float32)
    m64 = load(model_dir, adapter, overrides, torch.float64)
    cfg = m32.config
    eos = m32.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    vocab = cfg.vocab_size
    prompts = []
    tok = None
    if name.startswith("tiny"):
        tok = AutoTokenizer.from_pretrained(os.path.join(FIX, model_dir))
        texts = [t for t in TEXT_PROMPTS if safe_text(m32, m64, tok, t, eos)][:3]
        if len(texts) < 3:
            raise SystemExit(f"{name}: fewer than 3 text prompts with a margin >= {MIN_MARGIN}")
    else:
        texts = [None] * 3
    lengths = [1, 5, 12]
    for k, text in enumerate(texts):
        if text is not None:
            ids = tok(text).input_ids
            new = greedy(m32, ids, eos or None)
            picks, margin = margin_check(m64, ids, new)
            if margin < MIN_MARGIN:
                raise SystemExit(f"{name}: text prompt {text!r} has margin {margin:.2e}")
        else:
            # Of DRAWS random prompts with a safe margin, the one whose output varies most
            # (random tiny models often settle on one token).
            best = None
            for _ in range(draws):
                ids = torch.randint(3, vocab, (lengths[k],), generator=gen).tolist()
                new_ = greedy(m32, ids, eos or None)
                picks, margin_ = margin_check(m64, ids, new_)
                if picks != new_:
                    raise SystemExit(f"{name}: float64 picks {picks} differ from float32 {new_}")
                if margin_ < min_margin:
                    continue
                if best is None or len(set(new_)) > len(set(best[1])):
                    best = (ids, new_, margin_)
            if best is None:
                raise SystemExit(f"{name}: no prompt with a margin >= {min_margin}")
            ids, new, margin = best
            picks = new
        if picks != new:
            raise SystemExit(f"{name}: float64 picks {picks} differ from float32 {new}")
        stopped = "eos" if new and new[-1] in eos else "length"
        prompts.append(dict(ids=ids, text=text, expected=new, min_margin=margin, stopped=stopped,
                            eos_token_id=eos))
    # A prompt again, stopping at a token greedy writes at a later step (the latest of steps
    # 1..STOP_AT not written before it), as if it were the EOS.
    found = None
    for base in reversed(prompts):
        out_ = base["expected"]
        for s in range(min(STOP_AT, len(out_) - 1), 0, -1):
            if out_[s] not in out_[:s]:
                found = (base, s)
                break
        if found:
            break
    if found:
        base, s = found
        stop = base["expected"][s]
        new = greedy(m32, base["ids"], [stop])
        assert new == base["expected"][:s + 1], (new, base["expected"])
        prompts.append(dict(ids=base["ids"], text=base["text"], expected=new,
                            min_margin=base["min_margin"], stopped="eos", eos_token_id=[stop]))
    else:
        print(f"  {name}: every output repeats its first token: no stop case", flush=True)
    print(f"{name}: " + "; ".join(f"{len(p['ids'])}+{len(p['expected'])} ({p['stopped']}, margin "
                                  f"{p['min_margin']:.3g})" for p in prompts), flush=True)
    return dict(name=name, model=model_dir, adapter=adapter, config_overrides=overrides,
                generation_eos_token_id=eos, prompts=prompts)


def main():
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(27)
    cases = [run_case(*c, gen) for c in CASES]
    out = dict(
        about="transformers generate(do_sample=False) in float32, eager attention; written by "
              "scripts/reference_generate.py. Paths are relative to tests/fixtures.",
        max_new_tokens=MAX_NEW,
        versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                      peft=__import__("peft").__version__),
        cases=cases)
    d = os.path.join(FIX, "generate")
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "expected.json")
    tmp = p + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, p)
    print(f"wrote {p}")


if __name__ == "__main__":
    sys.exit(main())
