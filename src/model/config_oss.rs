//! gpt-oss's config.json (`model_type = "gpt_oss"`): its experts (`num_local_experts`,
//! `num_experts_per_tok`, `intermediate_size` the width of each) and the clamped SwiGLU's
//! `swiglu_limit` and `swiglu_alpha`. The rest (layer_types with sliding_window, head_dim,
//! attention_bias, YaRN in rope_scaling) is read as for every family (model/config.rs,
//! model/config_rope.rs, model/yarn.rs).
//!
//! transformers 5.17 fixes α = 1.702 and the limit at 7.0 whatever config.json says; 5.25 reads
//! both from it (defaults 1.702 and 7.0): the released checkpoints write swiglu_limit 7.0, on
//! which the two agree.

use super::config::Raw;
use super::family::{MoeSpec, OssMoe};

/// The largest expert count or width read (bounded before they size the experts).
const MAX_EXPERTS: usize = 1 << 12;

/// The experts and their activation of a gpt-oss config.
pub(super) fn moe_spec(raw: &Raw) -> Result<MoeSpec, String> {
    let experts = raw
        .num_local_experts
        .or(raw.num_experts)
        .filter(|&e| e > 0)
        .ok_or("`num_local_experts` is missing or 0")?;
    if experts > MAX_EXPERTS {
        return Err(format!(
            "num_local_experts {experts} is out of range (at most {MAX_EXPERTS})"
        ));
    }
    let top_k = raw.num_experts_per_tok.unwrap_or(4);
    if top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok {top_k} must be in 1..={experts} (num_local_experts)"
        ));
    }
    let inter = raw
        .intermediate_size
        .filter(|&i| i > 0)
        .ok_or("`intermediate_size` (each expert's width) is missing or 0")?;
    let positive = |key: &str, v: f64| match v.is_finite() && v > 0.0 {
        true => Ok(v),
        false => Err(format!(
            "{key} {v} must be a positive number (gpt-oss: {key} = {})",
            match key {
                "swiglu_limit" => "7.0",
                _ => "1.702",
            }
        )),
    };
    Ok(MoeSpec {
        experts,
        top_k,
        inter,
        norm_topk: false,
        oss: Some(OssMoe {
            alpha: positive("swiglu_alpha", raw.swiglu_alpha.unwrap_or(1.702))?,
            limit: positive("swiglu_limit", raw.swiglu_limit.unwrap_or(7.0))?,
        }),
    })
}

#[cfg(test)]
mod tests {
    use crate::model::{ModelConfig, RopeScaling};
    use std::path::Path;

    /// gpt-oss-20b's config.json as the Hub has it (hidden 2880, 24 layers alternating
    /// sliding 128 and full, 32 experts top 4, YaRN ×32 over 4096, biases, sinks).
    const GPT_OSS_20B: &str = r#"{"architectures":["GptOssForCausalLM"],
        "attention_bias":true,"attention_dropout":0.0,"eos_token_id":200002,
        "experts_per_token":4,"head_dim":64,"hidden_act":"silu","hidden_size":2880,
        "initial_context_length":4096,"initializer_range":0.02,"intermediate_size":2880,
        "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention",
        "sliding_attention","full_attention","sliding_attention","full_attention",
        "sliding_attention","full_attention","sliding_attention","full_attention",
        "sliding_attention","full_attention","sliding_attention","full_attention",
        "sliding_attention","full_attention","sliding_attention","full_attention",
        "sliding_attention","full_attention","sliding_attention","full_attention"],
        "max_position_embeddings":131072,"model_type":"gpt_oss","num_attention_heads":64,
        "num_experts_per_tok":4,"num_hidden_layers":24,"num_key_value_heads":8,
        "num_local_experts":32,"output_router_logits":false,"pad_token_id":199999,
        "quantization_config":{"modules_to_not_convert":["model.layers.*.self_attn",
        "model.layers.*.mlp.router","model.embed_tokens","lm_head"],"quant_method":"mxfp4"},
        "rms_norm_eps":1e-05,"rope_scaling":{"beta_fast":32.0,"beta_slow":1.0,"factor":32.0,
        "original_max_position_embeddings":4096,"rope_type":"yarn","truncate":false},
        "rope_theta":150000,"router_aux_loss_coef":0.9,"sliding_window":128,
        "swiglu_limit":7.0,"tie_word_embeddings":false,"transformers_version":"4.55.0.dev0",
        "use_cache":true,"vocab_size":201088}"#;

    #[test]
    fn reads_gpt_oss_20b_and_names_what_it_refuses() {
        // MXFP4 experts (quant::mxfp4) read as full precision: the same model as the bf16
        // copy's, the same config without its quantization_config
        let hub = ModelConfig::from_json(GPT_OSS_20B, Path::new("config.json")).unwrap();
        assert_eq!(hub.bnb_nf4, None);
        let q = r#""quantization_config":{"modules_to_not_convert":["model.layers.*.self_attn",
        "model.layers.*.mlp.router","model.embed_tokens","lm_head"],"quant_method":"mxfp4"},
        "#;
        assert!(GPT_OSS_20B.contains(q));
        let bf16 = GPT_OSS_20B.replace(q, "");
        let c = ModelConfig::from_json(&bf16, Path::new("config.json")).unwrap();
        assert_eq!(format!("{hub:?}"), format!("{c:?}"));
        let m = c.arch.moe.unwrap();
        assert_eq!((m.experts, m.top_k, m.inter), (32, 4, 2880));
        let o = m.oss.unwrap();
        assert_eq!((o.alpha, o.limit), (1.702, 7.0));
        assert!(c.arch.sinks && c.qkv_bias && c.o_bias && !c.arch.qk_norm);
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.sliding_window),
            (64, 8, Some(128))
        );
        assert_eq!((c.window(0), c.window(1)), (128, 0));
        assert!(matches!(
            c.rope_scaling,
            RopeScaling::Yarn {
                factor: 32.0,
                original_max_position: 4096,
                truncate: false,
                ..
            }
        ));
        assert_eq!(c.rope_theta, 150000.0);
        assert_eq!(c.linears(), ["q_proj", "k_proj", "v_proj", "o_proj"]);
        let named = vec![
            "mlp.experts.gate_up_proj".to_string(),
            "mlp.experts.down_proj".into(),
            "q_proj".into(),
        ];
        assert_eq!(
            c.resolve_targets(&named).unwrap(),
            [
                "q_proj",
                "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj"
            ]
        );
        assert!(c.attn_shape().sinks);
        for (from, to, want) in [
            (
                r#""swiglu_limit":7.0"#,
                r#""swiglu_limit":-1.0"#,
                "swiglu_limit -1 must be",
            ),
            (
                r#""num_experts_per_tok":4"#,
                r#""num_experts_per_tok":40"#,
                "must be in 1..=32",
            ),
            (
                r#""num_local_experts":32"#,
                r#""num_local_experts":0"#,
                "`num_local_experts`",
            ),
            (r#""beta_fast":32.0"#, r#""beta_fast":-3.0"#, "beta_fast -3"),
        ] {
            let bad = bf16.replace(from, to);
            let e = ModelConfig::from_json(&bad, Path::new("config.json"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{to}: {e}");
        }
    }
}
