//! The model shapes `bench`, `plan --shape` and `generate --bench` know by name: the released
//! models' config.json, as scripts/bench_peft.py builds them, read by the config layer every
//! checkpoint goes through; and the adapter targets those tools name ("all", "attn", "qv").

use super::ModelConfig;
use anyhow::{bail, Result};

/// The shapes `bench` and `plan --shape` know, as scripts/bench_peft.py's SHAPES.
pub(crate) const SHAPES: [&str; 11] = [
    "tiny",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "qwen3-8b",
    "gemma2-9b",
    "gemma3-12b",
    "phi3-mini",
    "qwen3-30b-a3b",
    "gpt-oss-20b",
];

/// A named shape's config.json (the released model's, as scripts/bench_peft.py builds it),
/// read by the config layer every checkpoint goes through: the family's data comes with it.
pub fn shape(name: &str) -> Result<ModelConfig> {
    use serde_json::json;
    let llama = |h: usize, i: usize, l: usize, nh: usize, kv: usize, v: usize, theta: f64| {
        json!({"model_type": "llama", "hidden_size": h, "intermediate_size": i,
               "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv,
               "vocab_size": v, "rope_theta": theta, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 4096, "tie_word_embeddings": false,
               "bos_token_id": 1, "eos_token_id": 2})
    };
    let cfg = match name {
        "tiny" => llama(256, 688, 4, 8, 8, 32000, 1e4),
        "llama2-7b" => llama(4096, 11008, 32, 32, 32, 32000, 1e4),
        "llama2-13b" => llama(5120, 13824, 40, 40, 40, 32000, 1e4),
        "llama2-70b" => llama(8192, 28672, 80, 64, 8, 32000, 1e4),
        // meta-llama/Llama-3.1-8B: llama3 rope scaling to 131072 positions
        "llama3-8b" => {
            let mut c = llama(4096, 14336, 32, 32, 8, 128256, 5e5);
            c["max_position_embeddings"] = json!(131072);
            c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192});
            c
        }
        // Qwen/Qwen3-8B
        "qwen3-8b" => json!({"model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "tie_word_embeddings": false}),
        // google/gemma-2-9b
        "gemma2-9b" => json!({"model_type": "gemma2", "hidden_size": 3584,
            "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
            "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}),
        // google/gemma-3-12b's text model
        "gemma3-12b" => json!({"model_type": "gemma3_text", "hidden_size": 3840,
            "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}),
        // microsoft/Phi-3.5-mini-instruct without its LongRoPE (which acts past 4096 tokens)
        "phi3-mini" => json!({"model_type": "phi3", "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32064, "rope_theta": 1e4,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": false,
            "hidden_act": "silu"}),
        // Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 a token, in every layer
        "qwen3-30b-a3b" => json!({"model_type": "qwen3_moe", "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
            "rope_theta": 1e6, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false, "attention_bias": false}),
        // openai/gpt-oss-20b (its bf16 weights: the Hub's MXFP4 experts dequantized): 32
        // experts of width 2880, 4 a token, in every layer; sliding (128) and full layers
        // alternating, attention sinks, YaRN ×32 over 4096, biases on q/k/v/o and the experts
        "gpt-oss-20b" => json!({"model_type": "gpt_oss", "hidden_size": 2880,
            "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
            "num_experts_per_tok": 4, "vocab_size": 201088, "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": false},
            "sliding_window": 128,
            "layer_types": (0..24).map(|l| match l % 2 {
                0 => "sliding_attention",
                _ => "full_attention",
            }).collect::<Vec<_>>(),
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": true,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "eos_token_id": 200002,
            "pad_token_id": 199999}),
        other => bail!("unknown shape `{other}`; known: {}", SHAPES.join(", ")),
    };
    let path = std::path::PathBuf::from(format!("<bench shape {name}>"));
    Ok(ModelConfig::from_json(&cfg.to_string(), &path)?)
}

/// `--targets` for a model: "all" its every linear and a MoE's fused experts (gate_up_proj
/// and down_proj, PEFT's `target_parameters`; the router not), "attn" its attention's, "qv" q
/// and v (Phi-3: its fused qkv_proj, as PEFT's default for it).
pub fn targets(name: &str, cfg: &ModelConfig) -> Result<Vec<String>> {
    let own = cfg.linears();
    let experts: &[&str] = match cfg.arch.moe {
        Some(_) => &super::family::EXPERT_PARAMS,
        None => &[],
    };
    let t: Vec<&str> = match name {
        "all" => own.iter().chain(experts).copied().collect(),
        "attn" => own
            .iter()
            .copied()
            .filter(|m| matches!(*m, "q_proj" | "k_proj" | "v_proj" | "qkv_proj" | "o_proj"))
            .collect(),
        "qv" if cfg.arch.fused => vec!["qkv_proj"],
        "qv" => vec!["q_proj", "v_proj"],
        other => bail!("unknown targets `{other}`; known: qv, attn, all"),
    };
    Ok(t.iter().map(|s| s.to_string()).collect())
}
