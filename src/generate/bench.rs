//! `lora-train generate --bench`: greedy decoding timed on random weights of a named shape
//! (`crate::model::shapes::shape`), measured as scripts/bench_generate_hf.py measures transformers'
//! `generate` with a static cache (same shapes, prompt, token counts and JSON fields), so that
//! the two run in one device call.
//!
//! A run is the prompt's prefill and `new_tokens` one-token steps (stop tokens ignored), each
//! reading back its token. One short warm-up run first, then `reps` timed runs; decode time
//! per token is their mean. A decode step reads every weight once, so its floor is weight
//! bytes / memory bandwidth: `bandwidth_fraction` is that floor over the measured time.
//! `host_ms_per_token` is the time a step's launches take to issue: near `ms_per_token`, the
//! host, not the device, sets the pace.

use super::{Decoder, Weights};
use crate::lora::LoraSpec;
use crate::model::Model;
use anyhow::{bail, Result};
use candle_core::{DType, Device};
use std::time::Instant;

/// What `generate --bench` times.
#[derive(Debug, Clone)]
pub struct DecodeBench {
    /// A shape `model::shapes::shape` knows (the weights are random).
    pub shape: String,
    /// Prompt tokens (random ids), prefilled in one call.
    pub prompt_len: usize,
    /// Tokens decoded greedily after the prompt.
    pub new_tokens: usize,
    /// Timed repetitions of prefill and decode.
    pub reps: usize,
    /// LoRA rank of random adapters (unmerged) on `targets`; 0 = the base alone.
    pub rank: usize,
    /// The adapted modules, a `shapes::targets` name ("all", "attn", "qv").
    pub targets: String,
    /// The weights' dtype.
    pub dtype: DType,
    /// Where it runs.
    pub device: Device,
    /// Memory bandwidth in bytes/s (H200: 4.8e12).
    pub bandwidth: f64,
}

/// Times `a`'s prefill and decode; the JSON row has scripts/bench_generate_hf.py's fields.
pub fn run(a: &DecodeBench) -> Result<serde_json::Value> {
    if a.prompt_len == 0 || a.new_tokens == 0 || a.reps == 0 {
        bail!("prompt_len, new_tokens and reps must be at least 1");
    }
    let mut cfg = crate::model::shapes::shape(&a.shape)?;
    let total = a.prompt_len + a.new_tokens;
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(total);
    let spec = LoraSpec {
        rank: a.rank.max(1),
        alpha: 2.0 * a.rank.max(1) as f64,
        dropout: 0.0,
        rslora: false,
        dora: false,
        targets: match a.rank {
            0 => Vec::new(),
            _ => crate::model::shapes::targets(&a.targets, &cfg)?,
        },
    };
    let vocab = cfg.vocab_size;
    let mut model = Model::random(cfg, a.dtype, &a.device, &spec, 0)?;
    let w = Weights::stacked(&mut model)?;
    let (weight_bytes, adapter_bytes) = (w.bytes_per_token(), w.adapter_bytes());
    let mut dec = Decoder::new(w, total)?;
    let mut rng = crate::rng::Rng::new(1);
    let prompt: Vec<u32> = (0..a.prompt_len).map(|_| rng.below(vocab) as u32).collect();
    // (prefill, decode, host): host is the time the steps' launches took to issue, before
    // each token's read-back waits for the device.
    let once = |dec: &mut Decoder, n: usize| -> Result<(f64, f64, f64)> {
        dec.cache.truncate(0);
        let t0 = Instant::now();
        let mut tok = super::decoder::argmax(&dec.extend(&prompt)?)?;
        let prefill = t0.elapsed().as_secs_f64();
        let (t1, mut host) = (Instant::now(), 0.0);
        for _ in 0..n {
            let t = Instant::now();
            let logits = dec.extend(&[tok])?;
            host += t.elapsed().as_secs_f64();
            tok = super::decoder::argmax(&logits)?;
        }
        Ok((prefill, t1.elapsed().as_secs_f64(), host))
    };
    once(&mut dec, a.new_tokens.min(8))?;
    let (mut prefill, mut decode, mut host) = (0.0, 0.0, 0.0);
    for _ in 0..a.reps {
        let (p, d, h) = once(&mut dec, a.new_tokens)?;
        prefill += p / a.reps as f64;
        decode += d / a.reps as f64;
        host += h / a.reps as f64;
    }
    let s_per_tok = decode / a.new_tokens as f64;
    // Keys and values a step reads, on average over the timed steps.
    let c = &dec.w.cfg;
    let kv_row = 2 * c.num_layers * c.num_kv_heads * c.head_dim * a.dtype.size_in_bytes();
    let kv_bytes = kv_row * (a.prompt_len + a.new_tokens / 2);
    let read = (weight_bytes + adapter_bytes) as f64;
    Ok(serde_json::json!({
        "impl": "lora-train",
        "shape": a.shape,
        "dtype": format!("{:?}", a.dtype).to_lowercase(),
        "device": if a.device.is_cuda() { "cuda" } else { "cpu" },
        "kernels": match (dec.fused_kernels(), dec.graph_captured()) {
            (true, true) => "fused+graph",
            (true, false) => "fused",
            _ => "candle",
        },
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "reps": a.reps,
        "rank": a.rank,
        "targets": if a.rank > 0 { a.targets.as_str() } else { "none" },
        "prefill_ms": prefill * 1e3,
        "ms_per_token": s_per_tok * 1e3,
        "tokens_per_s": 1.0 / s_per_tok,
        "host_ms_per_token": host / a.new_tokens as f64 * 1e3,
        "weight_bytes": weight_bytes,
        "adapter_bytes": adapter_bytes,
        "kv_bytes_per_token": kv_bytes,
        "bandwidth_Bps": a.bandwidth,
        "bandwidth_limit_ms": read / a.bandwidth * 1e3,
        "bandwidth_fraction": read / a.bandwidth / s_per_tok,
    }))
}
