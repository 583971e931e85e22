//! Hugging Face tensor names → llama.cpp's GGUF names (gguf-py's `TENSOR_NAMES` and
//! `tensor_mapping.py`, as convert_hf_to_gguf.py applies them), per family, and the row order
//! llama.cpp wants for q and k.
//!
//! | HF (`model.layers.N.` …)          | GGUF (`blk.N.` …)                         |
//! |-----------------------------------|-------------------------------------------|
//! | input_layernorm                   | attn_norm                                 |
//! | self_attn.{q,k,v,o}_proj          | attn_q, attn_k, attn_v, attn_output       |
//! | self_attn.qkv_proj (Phi-3)        | attn_qkv                                  |
//! | self_attn.{q,k}_norm              | attn_q_norm, attn_k_norm                  |
//! | post_attention_layernorm          | ffn_norm (Gemma: post_attention_norm)     |
//! | pre_feedforward_layernorm (Gemma) | ffn_norm                                  |
//! | post_feedforward_layernorm (Gemma)| post_ffw_norm                             |
//! | mlp.{gate,up,down}_proj           | ffn_gate, ffn_up, ffn_down                |
//! | mlp.gate_up_proj (Phi-3)          | ffn_up                                    |
//! | mlp.gate (MoE router)             | ffn_gate_inp                              |
//! | mlp.experts.… (stacked [E, …])    | ffn_gate_exps, ffn_up_exps, ffn_down_exps |
//!
//! plus `model.embed_tokens` → token_embd, `model.norm` → output_norm, `lm_head` → output.

use crate::model::Family;

/// llama.cpp's architecture name of a family (gguf-py's `MODEL_ARCH_NAMES`): Mistral is
/// written as llama, as convert_hf_to_gguf.py's `LlamaModel` writes `MistralForCausalLM`.
pub(crate) fn arch_name(family: Family) -> &'static str {
    match family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Qwen3Moe => "qwen3moe",
        Family::Gemma2 => "gemma2",
        Family::Gemma3 => "gemma3",
        Family::Phi3 => "phi3",
        Family::GptOss => "gpt-oss",
    }
}

/// Whether q and k rows are reordered for llama.cpp's rotary (llama's `undo_permute`: the
/// Hugging Face checkpoint pairs dimension i with i + D/2, llama.cpp's "normal" rope pairs
/// 2i with 2i + 1). The other families run NeoX-style rope in llama.cpp and keep HF's order.
pub(crate) fn permutes_qk(family: Family) -> bool {
    matches!(family, Family::Llama | Family::Mistral)
}

/// Which of a layer's attention projections a tensor is, for the rotary row order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rotary {
    /// Not rotated (or the family keeps HF's order).
    None,
    /// q: `num_heads` heads.
    Q,
    /// k: `num_kv_heads` heads.
    K,
}

/// A checkpoint tensor's place in the GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapped {
    /// The GGUF name, e.g. `blk.0.attn_q.weight`.
    pub(crate) name: String,
    /// The layer, for per-layer tensors.
    pub(crate) layer: Option<usize>,
    /// q or k of a family whose rows llama.cpp wants reordered.
    pub(crate) rotary: Rotary,
}

/// What a checkpoint tensor becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// One GGUF tensor.
    One(Mapped),
    /// Expert `expert`'s slice of a stacked `[E, …]` GGUF tensor (Qwen3-MoE's
    /// `mlp.experts.E.{gate,up,down}_proj.weight`).
    Expert { mapped: Mapped, expert: usize },
    /// Every expert at once, stacked already (`mlp.experts.down_proj` [E, C, I]), or gate and
    /// up fused on dim 1 (`mlp.experts.gate_up_proj` [E, 2I, C]: split into two GGUF tensors).
    Experts(Vec<Mapped>),
    /// Dropped as convert_hf_to_gguf.py drops it (Gemma 2's `lm_head`, rotary caches).
    Skip,
}

/// A layer tensor's GGUF base name (without `blk.N.` and the suffix), from its HF name after
/// `model.layers.N.`; None if llama.cpp has no such tensor for the family.
fn layer_base(family: Family, rest: &str) -> Option<&'static str> {
    let gemma = family.gemma();
    Some(match rest {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.qkv_proj" if family == Family::Phi3 => "attn_qkv",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" if gemma => "ffn_norm",
        "post_feedforward_layernorm" if gemma => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate_up_proj" if family == Family::Phi3 => "ffn_up",
        "mlp.gate" if family == Family::Qwen3Moe => "ffn_gate_inp",
        _ => return None,
    })
}

/// The GGUF name of an expert projection (`gate_proj` → `ffn_gate_exps`).
fn expert_base(proj: &str) -> Option<&'static str> {
    Some(match proj {
        "gate_proj" => "ffn_gate_exps",
        "up_proj" => "ffn_up_exps",
        "down_proj" => "ffn_down_exps",
        _ => return None,
    })
}

/// Where checkpoint tensor `hf` goes; Err names a tensor llama.cpp has no place for.
pub(crate) fn target(family: Family, hf: &str) -> Result<Target, String> {
    let unknown = || {
        format!(
            "tensor `{hf}` has no llama.cpp name for {}",
            arch_name(family)
        )
    };
    if hf.ends_with(".rotary_emb.inv_freq") || (family == Family::Gemma2 && hf == "lm_head.weight")
    {
        return Ok(Target::Skip);
    }
    let global = |name: &str| {
        Target::One(Mapped {
            name: name.into(),
            layer: None,
            rotary: Rotary::None,
        })
    };
    match hf {
        "model.embed_tokens.weight" => return Ok(global("token_embd.weight")),
        "model.norm.weight" => return Ok(global("output_norm.weight")),
        "lm_head.weight" => return Ok(global("output.weight")),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").ok_or_else(unknown)?;
    let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let mapped = |base: &str, suffix: &str, rotary: Rotary| Mapped {
        name: format!("blk.{layer}.{base}.{suffix}"),
        layer: Some(layer),
        rotary,
    };
    if let Some(e) = rest.strip_prefix("mlp.experts.") {
        return expert_target(family, e, &mapped).ok_or_else(unknown);
    }
    let (module, suffix) = rest.rsplit_once('.').ok_or_else(unknown)?;
    if suffix != "weight" && suffix != "bias" {
        return Err(unknown());
    }
    let base = layer_base(family, module).ok_or_else(unknown)?;
    let rotary = match base {
        "attn_q" if permutes_qk(family) => Rotary::Q,
        "attn_k" if permutes_qk(family) => Rotary::K,
        _ => Rotary::None,
    };
    Ok(Target::One(mapped(base, suffix, rotary)))
}

/// An expert tensor's target, from its name after `mlp.experts.`: `E.gate_proj.weight` (one
/// expert), `gate_up_proj` / `down_proj` (all experts, transformers 5's fused parameters).
fn expert_target(
    family: Family,
    rest: &str,
    mapped: &dyn Fn(&str, &str, Rotary) -> Mapped,
) -> Option<Target> {
    if family != Family::Qwen3Moe {
        return None;
    }
    let rest = rest.strip_suffix(".weight").unwrap_or(rest);
    match rest {
        "gate_up_proj" => Some(Target::Experts(vec![
            mapped("ffn_gate_exps", "weight", Rotary::None),
            mapped("ffn_up_exps", "weight", Rotary::None),
        ])),
        "down_proj" => Some(Target::Experts(vec![mapped(
            "ffn_down_exps",
            "weight",
            Rotary::None,
        )])),
        _ => {
            let (expert, proj) = rest.split_once('.')?;
            let expert = expert.parse().ok()?;
            let base = expert_base(proj)?;
            Some(Target::Expert {
                mapped: mapped(base, "weight", Rotary::None),
                expert,
            })
        }
    }
}

/// The permutation of q or k rows that llama.cpp's rotary wants: within each of `heads` heads
/// of `rows / heads` rows, new row 2b + a is old row a·D/2 + b (a ∈ {0, 1}, b < D/2), as
/// convert_hf_to_gguf.py's `LlamaModel.permute` reshapes (heads, 2, D/2, …) → (heads, D/2, 2, …).
/// Returns, for each new row, the old row it takes.
pub(crate) fn rotary_rows(rows: usize, heads: usize) -> Result<Vec<usize>, String> {
    if heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
        return Err(format!(
            "{rows} rows do not split into {heads} heads of an even size (rotary reorder)"
        ));
    }
    let d = rows / heads;
    let half = d / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..heads {
        for b in 0..half {
            for a in 0..2 {
                order.push(h * d + a * half + b);
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_rows_interleave_the_halves_of_each_head() {
        // 2 heads of 4 rows: [0 1 | 2 3] [4 5 | 6 7] → 0 2 1 3, 4 6 5 7
        assert_eq!(rotary_rows(8, 2).unwrap(), [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(rotary_rows(6, 4).is_err());
    }

    #[test]
    fn names_follow_the_family() {
        let one = |f, n| match target(f, n).unwrap() {
            Target::One(m) => m.name,
            t => panic!("{t:?}"),
        };
        assert_eq!(
            one(
                Family::Gemma2,
                "model.layers.3.post_attention_layernorm.weight"
            ),
            "blk.3.post_attention_norm.weight"
        );
        assert_eq!(
            one(
                Family::Llama,
                "model.layers.3.post_attention_layernorm.weight"
            ),
            "blk.3.ffn_norm.weight"
        );
        assert_eq!(
            one(Family::Phi3, "model.layers.0.mlp.gate_up_proj.weight"),
            "blk.0.ffn_up.weight"
        );
        assert_eq!(target(Family::Gemma2, "lm_head.weight"), Ok(Target::Skip));
        assert!(target(Family::Llama, "model.layers.0.mlp.gate_up_proj.weight").is_err());
    }
}
