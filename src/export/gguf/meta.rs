//! The architecture keys (`<arch>.*`) and the `general.*` keys of a GGUF file, as
//! convert_hf_to_gguf.py writes them for each family from config.json (read as transformers
//! 5 reads it: `rope_parameters`, `head_dim` filled in where the family's config class has
//! one).
//!
//! | family          | keys beyond the common ones (block_count, context_length, embedding_length, feed_forward_length, head_count, head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon) |
//! |-----------------|------------------------------------------------------------------|
//! | llama, mistral  | vocab_size, rope.dimension_count, key/value_length; llama3 rope: `rope_freqs` tensor |
//! | qwen2           | key/value_length only when config.json has head_dim               |
//! | qwen3, qwen3moe | key/value_length; MoE: expert_count, expert_used_count, expert_feed_forward_length |
//! | gemma2          | its own list: key/value_length, attn/final logit soft-caps, sliding_window, no rope key |
//! | gemma3          | rope.freq_base_swa, linear rope scaling, final soft-cap if set, sliding_window |
//! | phi3            | its own list: rope.dimension_count, rope.scaling.original_context_length, sliding_window (0 if none); longrope: attn_factor + `rope_factors_*` tensors |

use super::Kv;
use crate::model::{Family, ModelConfig, RopeScaling};
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;

/// gguf-py's GGML_QUANT_VERSION.
pub(crate) const QUANT_VERSION: u32 = 2;

/// An `<arch>.*` key list being built.
struct Arch<'a> {
    arch: &'a str,
    kv: Vec<Kv>,
}

impl Arch<'_> {
    fn u32(&mut self, k: &str, v: usize) {
        self.kv
            .push((format!("{}.{k}", self.arch), Value::U32(v as u32)));
    }
    fn f32(&mut self, k: &str, v: f64) {
        self.kv
            .push((format!("{}.{k}", self.arch), Value::F32(v as f32)));
    }
    fn str(&mut self, k: &str, v: &str) {
        self.kv
            .push((format!("{}.{k}", self.arch), Value::String(v.into())));
    }
}

/// config.json's rope settings of the full-attention layers, as one object (transformers 5's
/// `rope_parameters`, its `full_attention` entry where it has one per layer type, or 4.x's
/// `rope_scaling` with `rope_theta` beside it).
fn rope_params(raw: &Json) -> Json {
    let rp = raw
        .get("rope_parameters")
        .or_else(|| raw.get("rope_scaling"))
        .filter(|v| v.is_object())
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    let mut full = rp.get("full_attention").cloned().unwrap_or(rp);
    if let Some(o) = full.as_object_mut() {
        if !o.contains_key("rope_type") {
            if let Some(t) = o.get("type").cloned() {
                o.insert("rope_type".into(), t);
            }
        }
        if !o.contains_key("rope_theta") {
            if let Some(t) = raw.get("rope_theta").cloned() {
                o.insert("rope_theta".into(), t);
            }
        }
    }
    full
}

/// TextModel.set_gguf_parameters: the keys every family but Gemma 2 and Phi-3 starts from.
fn common(a: &mut Arch, cfg: &ModelConfig, raw: &Json, head_dim: bool) {
    a.u32("block_count", cfg.num_layers);
    a.u32("context_length", cfg.max_position_embeddings);
    a.u32("embedding_length", cfg.hidden_size);
    a.u32("feed_forward_length", cfg.intermediate_size);
    a.u32("attention.head_count", cfg.num_heads);
    a.u32("attention.head_count_kv", cfg.num_kv_heads);
    let rp = rope_params(raw);
    match (rp["rope_type"].as_str(), rp["factor"].as_f64()) {
        (Some("linear"), Some(f)) => {
            a.str("rope.scaling.type", "linear");
            a.f32("rope.scaling.factor", f);
        }
        (Some("yarn"), Some(f)) => {
            a.str("rope.scaling.type", "yarn");
            a.f32("rope.scaling.factor", f);
            if let Some(n) = rp["original_max_position_embeddings"].as_u64() {
                a.u32("rope.scaling.original_context_length", n as usize);
            }
        }
        (Some("su" | "longrope"), _) => a.str("rope.scaling.type", "longrope"),
        _ => {}
    }
    a.f32("rope.freq_base", cfg.rope_theta);
    if let Some(local) = &cfg.arch.local_rope {
        a.f32("rope.freq_base_swa", local.theta);
    }
    a.f32("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps);
    if let Some(m) = cfg.arch.moe {
        a.u32("expert_count", m.experts);
        a.u32("expert_used_count", m.top_k);
    }
    if head_dim {
        a.u32("attention.key_length", cfg.head_dim);
        a.u32("attention.value_length", cfg.head_dim);
    }
}

/// The `<arch>.*` keys of the family (file type included: `general.file_type`).
pub(crate) fn arch_keys(arch: &str, cfg: &ModelConfig, raw: &Json, file_type: u32) -> Vec<Kv> {
    let mut a = Arch {
        arch,
        kv: Vec::new(),
    };
    let file = |a: &mut Arch| {
        a.kv.push(("general.file_type".into(), Value::U32(file_type)))
    };
    match cfg.family {
        Family::Gemma2 => {
            a.u32("context_length", cfg.max_position_embeddings);
            a.u32("embedding_length", cfg.hidden_size);
            a.u32("block_count", cfg.num_layers);
            a.u32("feed_forward_length", cfg.intermediate_size);
            a.u32("attention.head_count", cfg.num_heads);
            a.u32("attention.head_count_kv", cfg.num_kv_heads);
            a.f32("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps);
            a.u32("attention.key_length", cfg.head_dim);
            a.u32("attention.value_length", cfg.head_dim);
            file(&mut a);
            a.f32(
                "attn_logit_softcapping",
                cfg.arch.attn_softcap.unwrap_or(0.0),
            );
            a.f32(
                "final_logit_softcapping",
                cfg.arch.final_softcap.unwrap_or(0.0),
            );
            a.u32("attention.sliding_window", raw_window(raw));
        }
        Family::Phi3 => phi3(&mut a, cfg, raw, file_type),
        Family::Gemma3 => {
            common(&mut a, cfg, raw, true);
            file(&mut a);
            if let Some(c) = cfg.arch.final_softcap.filter(|&c| c != 0.0) {
                a.f32("final_logit_softcapping", c);
            }
            if raw.get("sliding_window_pattern").and_then(Json::as_u64) != Some(1) {
                a.u32("attention.sliding_window", raw_window(raw));
            }
        }
        f => {
            let llama = matches!(f, Family::Llama | Family::Mistral);
            let head_dim = match f {
                Family::Qwen2 => raw.get("head_dim").is_some_and(|v| !v.is_null()),
                _ => true,
            };
            common(&mut a, cfg, raw, head_dim);
            file(&mut a);
            if let Some(m) = cfg.arch.moe {
                a.u32("expert_feed_forward_length", m.inter);
            }
            if llama {
                a.u32("vocab_size", cfg.vocab_size);
                a.u32("rope.dimension_count", cfg.head_dim);
            }
        }
    }
    a.kv
}

/// config.json's `sliding_window` (0 when absent or null).
fn raw_window(raw: &Json) -> usize {
    raw.get("sliding_window")
        .and_then(Json::as_u64)
        .unwrap_or(0) as usize
}

/// Phi3MiniModel.set_gguf_parameters, and the LongRoPE attention factor.
fn phi3(a: &mut Arch, cfg: &ModelConfig, raw: &Json, file_type: u32) {
    let rp = rope_params(raw);
    let orig = rp["original_max_position_embeddings"]
        .as_u64()
        .or_else(|| raw["original_max_position_embeddings"].as_u64())
        .unwrap_or(cfg.max_position_embeddings as u64) as usize;
    let rot = rp["partial_rotary_factor"]
        .as_f64()
        .or_else(|| raw["partial_rotary_factor"].as_f64())
        .unwrap_or(1.0);
    let rope_dims = (rot * cfg.hidden_size as f64) as usize / cfg.num_heads;
    a.u32("context_length", cfg.max_position_embeddings);
    a.u32("rope.scaling.original_context_length", orig);
    a.u32("embedding_length", cfg.hidden_size);
    a.u32("feed_forward_length", cfg.intermediate_size);
    a.u32("block_count", cfg.num_layers);
    a.u32("attention.head_count", cfg.num_heads);
    a.u32("attention.head_count_kv", cfg.num_kv_heads);
    a.f32("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps);
    a.u32("rope.dimension_count", rope_dims);
    a.f32("rope.freq_base", cfg.rope_theta);
    a.kv.push(("general.file_type".into(), Value::U32(file_type)));
    a.u32("attention.sliding_window", raw_window(raw));
    if let RopeScaling::LongRope { .. } = cfg.rope_scaling {
        let scale = cfg.max_position_embeddings as f64 / orig as f64;
        let f = match scale > 1.0 {
            true => (1.0 + scale.ln() / (orig as f64).ln()).sqrt(),
            false => 1.0,
        };
        a.f32("rope.scaling.attn_factor", f);
    }
}

/// llama.cpp's per-frequency factors of Llama 3.1 rope (`rope_freqs`, [head_dim / 2] f32), as
/// convert_hf_to_gguf.py's `LlamaModel.generate_extra_tensors` computes them; None for other
/// rope.
pub(crate) fn llama3_rope_freqs(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position,
    } = cfg.rope_scaling
    else {
        return None;
    };
    let dim = cfg.head_dim;
    let old = original_max_position as f64;
    let (low_wl, high_wl) = (old / low_freq_factor, old / high_freq_factor);
    let out = (0..dim)
        .step_by(2)
        .map(|i| {
            // torch computes the frequency in f32: base ** (i / dim) then 1 / that.
            let e = i as f32 / dim as f32;
            let freq = 1.0f32 / (cfg.rope_theta as f32).powf(e);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            if wavelen < high_wl {
                1.0
            } else if wavelen > low_wl {
                factor as f32
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    Some(out)
}

/// Phi-3's LongRoPE factors (`rope_factors_long`, `rope_factors_short`), when it has them.
pub(crate) fn phi3_rope_factors(cfg: &ModelConfig) -> Option<(Vec<f32>, Vec<f32>)> {
    match &cfg.rope_scaling {
        RopeScaling::LongRope { short, long, .. } => Some((
            long.iter().map(|&x| x as f32).collect(),
            short.iter().map(|&x| x as f32).collect(),
        )),
        _ => None,
    }
}

/// gguf-py's `model_weight_count_rounded_notation`: 1.1M, 7.2B, 950K.
fn rounded(n: u64) -> String {
    let n = n as f64;
    let (x, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    // Python's round(): half to even.
    let r = x.round_ties_even() as u64;
    let digits = r.to_string().trim_start_matches('0').len();
    let fix = 2usize.saturating_sub(digits);
    format!("{x:.fix$}{suffix}")
}

/// `general.size_label`: the parameter count, or "<E>x<per-expert size>" for a MoE.
/// `tensors`: (name, element count, experts when stacked).
pub(crate) fn size_label(tensors: &[(String, u64, Option<u64>)]) -> String {
    let (mut shared, mut expert, mut sum, mut n) = (0u64, 0u64, 0u64, 0u64);
    for (name, size, experts) in tensors {
        match experts.filter(|_| name.contains("_exps.")) {
            Some(e) if e > 0 => {
                expert += size / e;
                sum += e;
                n += 1;
            }
            _ => shared += size,
        }
    }
    match n {
        0 => rounded(shared),
        _ => format!("{}x{}", sum / n, rounded(shared + expert)),
    }
}

/// `general.sampling.*` from generation_config.json (gguf-py's Metadata reads it).
pub(crate) fn sampling_keys(gen: &Json) -> Vec<Kv> {
    let mut kv: Vec<Kv> = Vec::new();
    if let Some(k) = gen.get("top_k").and_then(Json::as_i64) {
        kv.push(("general.sampling.top_k".into(), Value::I32(k as i32)));
    }
    let f = |k: &str| gen.get(k).and_then(Json::as_f64);
    for (src, key) in [
        ("top_p", "general.sampling.top_p"),
        ("min_p", "general.sampling.min_p"),
        ("temperature", "general.sampling.temp"),
    ] {
        if let Some(x) = f(src) {
            kv.push((key.into(), Value::F32(x as f32)));
        }
    }
    if let Some(x) = f("penalty_repeat").or_else(|| f("repetition_penalty")) {
        kv.push((
            "general.sampling.penalty_repeat".into(),
            Value::F32(x as f32),
        ));
    }
    kv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_labels_round_as_gguf_py() {
        assert_eq!(rounded(1_100_000), "1.1M");
        assert_eq!(rounded(6_738_415_616), "6.7B");
        assert_eq!(rounded(74_000), "74K");
        assert_eq!(rounded(999), "1.0K");
        let t = vec![
            ("blk.0.ffn_up_exps.weight".to_string(), 8 * 100, Some(8)),
            ("token_embd.weight".to_string(), 1000, None),
        ];
        assert_eq!(size_label(&t), "8x1.1K");
    }
}
