//! What differs between the families we train, as data: the config-reading layer
//! (model/config.rs) fills an `Arch` from config.json, and the one decoder layer
//! (model/layer.rs, model/layer_train.rs) branches on it; no family has a model file of its own.
//!
//! | family      | norm gain      | MLP    | QK-norm | sandwich norms | fused projections | extras |
//! |-------------|----------------|--------|---------|----------------|-------------------|--------|
//! | llama       | w · round(x̂)   | SwiGLU |         |                |                   | llama3 rope |
//! | mistral     | w · round(x̂)   | SwiGLU |         |                |                   | sliding window |
//! | qwen2       | w · round(x̂)   | SwiGLU |         |                |                   | q/k/v bias |
//! | qwen3       | w · round(x̂)   | SwiGLU | yes     |                |                   | |
//! | gemma2      | (1 + w) · x̂    | GeGLU  |         | yes            |                   | soft-caps, 1:1 local:global, √C embedding |
//! | gemma3_text | (1 + w) · x̂    | GeGLU  | yes     | yes            |                   | 5:1 local:global, local rope base, √C embedding |
//! | phi3        | w · round(x̂)   | SwiGLU |         |                | qkv_proj, gate_up_proj | longrope |
//! | qwen3_moe   | w · round(x̂)   | SwiGLU experts, top-k router | yes |     |                   | MoE (model/layer_moe.rs) |
//! | gpt_oss     | w · round(x̂)   | clamped SwiGLU experts with biases, biased router | | |       | attention sinks, 1:1 sliding:full, YaRN, q/k/v/o bias |
//!
//! Gemma's gain is applied in f32 to the unrounded x̂ (`ops::NormSpec::offset`), as
//! `Gemma2RMSNorm` does.

use crate::model::RopeScaling;
use crate::ops::glu::Act;

/// Which architecture the checkpoint is (config.json's `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Qwen3Moe,
    GptOss,
}

/// The `model_type`s we train, with their family.
pub(crate) const SUPPORTED: [(&str, Family); 9] = [
    ("llama", Family::Llama),
    ("mistral", Family::Mistral),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("gemma2", Family::Gemma2),
    ("gemma3_text", Family::Gemma3),
    ("phi3", Family::Phi3),
    ("qwen3_moe", Family::Qwen3Moe),
    ("gpt_oss", Family::GptOss),
];

impl Family {
    /// The family of a config.json `model_type`; None for one we do not train.
    pub(crate) fn of(model_type: &str) -> Option<Family> {
        SUPPORTED
            .iter()
            .find(|(name, _)| *name == model_type)
            .map(|&(_, f)| f)
    }

    /// config.json's `model_type` for this family.
    pub(crate) fn model_type(self) -> &'static str {
        SUPPORTED
            .iter()
            .find(|(_, f)| *f == self)
            .map_or("llama", |&(name, _)| name)
    }

    /// The supported `model_type`s, for error messages.
    pub(crate) fn supported_list() -> String {
        SUPPORTED.map(|(n, _)| n).join(", ")
    }

    /// Whether the family's norms use Gemma's (1 + w) gain.
    pub(crate) fn gemma(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3)
    }

    /// The LoRA-targetable linears of one decoder layer, in checkpoint order.
    pub(crate) fn linears(self) -> &'static [&'static str] {
        match self {
            Family::Phi3 => &FUSED_LINEAR,
            // the experts are 3-D parameters, not linears (`EXPERT_PARAMS`)
            Family::Qwen3Moe | Family::GptOss => &ATTN_LINEAR,
            _ => &ALL_LINEAR,
        }
    }
}

/// The recipe's module names (`recipe::KNOWN_LINEAR`), the one list each family's is cut from.
const K: [&str; 11] = crate::recipe::KNOWN_LINEAR;

/// The seven linear modules of a Llama-family decoder layer, in checkpoint order.
pub const ALL_LINEAR: [&str; 7] = [K[0], K[1], K[2], K[3], K[4], K[5], K[6]];

/// A MoE's fused expert parameters LoRA can adapt, as PEFT's `target_parameters` names them:
/// gate_up_proj [E, 2I, C] and down_proj [E, C, I] of `model.layers.N.mlp.experts`. PEFT gives
/// each one adapter over all experts, A [E·r, in] (expert e's rows e·r..) and B [out, r·E]
/// (expert e's columns e, E + e, ..); model/layer_moe.rs.
pub const EXPERT_PARAMS: [&str; 2] = [K[9], K[10]];

/// Phi-3's linears: q, k, v in one projection (qkv_proj), gate and up in another
/// (gate_up_proj), as PEFT names them; then o_proj and down_proj.
pub(crate) const FUSED_LINEAR: [&str; 4] = [K[7], K[3], K[8], K[6]];

/// Qwen3-MoE's and gpt-oss's linears: the attention's (its MLP is the experts and the router).
pub(crate) const ATTN_LINEAR: [&str; 4] = [K[0], K[1], K[2], K[3]];

/// A sparse MLP's shape and routing (config.json's num_experts or num_local_experts,
/// num_experts_per_tok, moe_intermediate_size, norm_topk_prob; gpt-oss's swiglu_limit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// E: experts per layer.
    pub(crate) experts: usize,
    /// Experts per token.
    pub(crate) top_k: usize,
    /// Each expert's intermediate width I.
    pub(crate) inter: usize,
    /// The top-k probabilities renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob).
    pub(crate) norm_topk: bool,
    /// gpt-oss's experts and router in place of Qwen3-MoE's (model/config_oss.rs).
    pub(crate) oss: Option<OssMoe>,
}

/// gpt-oss's MoE: the router's bias and its softmax over the top-k logits; the experts'
/// biases, gate and up interleaved in gate_up_proj's columns, and the clamped SwiGLU
/// (up + 1) ⊙ g·σ(α·g) with g = min(gate, limit), up clamped to ±limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OssMoe {
    /// α: the sigmoid's gain (swiglu_alpha, 1.702).
    pub(crate) alpha: f64,
    /// The clamp (swiglu_limit, 7.0).
    pub(crate) limit: f64,
}

/// How a norm applies its gain w to x̂ = x · rsqrt(mean(x²) + eps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormStyle {
    /// w · round(x̂) (LlamaRMSNorm: x̂ is cast to the activation dtype first).
    Llama,
    /// (1 + w) · x̂ in f32, then rounded (Gemma2RMSNorm / Gemma3RMSNorm).
    Gemma,
}

/// One RoPE table's parameters.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rope {
    pub(crate) theta: f64,
    pub(crate) scaling: RopeScaling,
}

/// The family differences of a checkpoint, resolved from config.json.
#[derive(Debug, Clone, PartialEq)]
pub struct Arch {
    pub(crate) norm: NormStyle,
    /// The MLP's gate activation.
    pub(crate) act: Act,
    /// RMSNorm over each head of q and k (gains [D]) after the projection, before RoPE.
    pub(crate) qk_norm: bool,
    /// Norms on the attention's and the MLP's outputs before their residual adds (Gemma's
    /// post_attention_layernorm and post_feedforward_layernorm); the MLP's input norm is then
    /// pre_feedforward_layernorm.
    pub(crate) sandwich_norms: bool,
    /// One q/k/v projection and one gate/up projection (Phi-3).
    pub(crate) fused: bool,
    /// Embeddings × √hidden, the factor rounded to the model dtype (Gemma).
    pub(crate) embed_scale: bool,
    /// Attention scores × this^-1/2 (Gemma's query_pre_attn_scalar; else head_dim).
    pub(crate) query_pre_attn_scalar: Option<f64>,
    /// Attention scores → cap · tanh(scores / cap) before the softmax (Gemma 2).
    pub(crate) attn_softcap: Option<f64>,
    /// Logits → cap · tanh(logits / cap) (Gemma 2).
    pub(crate) final_softcap: Option<f64>,
    /// Per layer: whether it attends within `ModelConfig::sliding_window` (else full).
    pub(crate) sliding: Vec<bool>,
    /// The sliding layers' RoPE where it differs from the global one (Gemma 3's local base).
    pub(crate) local_rope: Option<Rope>,
    /// Every layer's MLP is a mixture of experts (Qwen3-MoE: softmax over the experts, top-k;
    /// gpt-oss: top-k of the logits, softmax over those).
    pub moe: Option<MoeSpec>,
    /// A learned logit per head joins each row's softmax denominator (gpt-oss's
    /// `self_attn.sinks` [H]): the probabilities over the keys sum to less than 1.
    pub(crate) sinks: bool,
}

impl Arch {
    /// Llama's: no family extra, every layer full attention.
    pub(crate) fn llama(layers: usize) -> Arch {
        Arch {
            norm: NormStyle::Llama,
            act: Act::Silu,
            qk_norm: false,
            sandwich_norms: false,
            fused: false,
            embed_scale: false,
            query_pre_attn_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            sliding: vec![false; layers],
            local_rope: None,
            moe: None,
            sinks: false,
        }
    }

    /// The defaults of a family with `layers` layers, before config.json's own values.
    pub(crate) fn of(family: Family, layers: usize) -> Arch {
        let base = Arch::llama(layers);
        match family {
            Family::Llama | Family::Mistral | Family::Qwen2 => base,
            // `moe` is filled from config.json (model/config_oss.rs)
            Family::GptOss => Arch {
                sinks: true,
                ..base
            },
            // `moe` is filled from config.json (model/config.rs)
            Family::Qwen3 | Family::Qwen3Moe => Arch {
                qk_norm: true,
                ..base
            },
            Family::Phi3 => Arch {
                fused: true,
                ..base
            },
            Family::Gemma2 | Family::Gemma3 => Arch {
                norm: NormStyle::Gemma,
                act: Act::GeluTanh,
                qk_norm: family == Family::Gemma3,
                sandwich_norms: true,
                embed_scale: true,
                ..base
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ALL_LINEAR, ATTN_LINEAR, EXPERT_PARAMS, FUSED_LINEAR};

    /// The families' lists cut from the recipe's names are the checkpoints' names, in the
    /// checkpoints' order (a reordered `KNOWN_LINEAR` would change them).
    #[test]
    fn each_familys_linears_are_its_checkpoints_names_in_order() {
        let words = |v: &[&str]| v.join(" ");
        let llama = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj";
        assert_eq!(words(&ALL_LINEAR), llama);
        assert_eq!(words(&ATTN_LINEAR), "q_proj k_proj v_proj o_proj");
        let fused = "qkv_proj o_proj gate_up_proj down_proj";
        assert_eq!(words(&FUSED_LINEAR), fused);
        let experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];
        assert_eq!(EXPERT_PARAMS, experts);
    }
}
