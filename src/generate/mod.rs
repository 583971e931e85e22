//! Generation from our `Model`: a base, a base with LoRA adapters applied unmerged
//! (y = W x + s·B·A·x, no dropout), or a merged checkpoint loaded plainly.
//!
//! The prompt runs once (prefill, in chunks for long prompts), then one token at a time
//! against a KV cache allocated for prompt + max_new_tokens and written in place; every family
//! we train decodes, with training's layer settings (`LayerSpec`): RoPE at each token's
//! absolute position (linear, Llama-3 and LongRoPE scaling as `model::rope`; Gemma 3's local
//! base), GQA, Qwen2's q/k/v biases, QK-norm, Gemma's norms, GeGLU, soft-caps and per-layer
//! windows, Phi-3's fused projections, Qwen3-MoE's routed experts; logits for the last
//! position only. Greedy output equals transformers' `generate(do_sample=False)` token for
//! token on the golden fixtures of every family (Phi-3's LongRoPE: transformers' greedy
//! through its KV cache, as its generate() loses the context where the table switches;
//! tests/it/generate.rs; references by scripts/reference_generate.py).
//!
//! - `weights`: the model's tensors as decoding reads them (q/k/v and gate/up stacked into one
//!   GEMM each for a model we own, adapters joined per group);
//! - `cache`: the KV cache and the rotary tables of its positions;
//! - `decoder`: the forward against the cache;
//! - `sample`: greedy, temperature, top-k, top-p from a seeded stream;
//! - `stream`: incremental decoding of text as tokens arrive;
//! - `load`: a base + adapter, a merged directory, or a recipe's output;
//! - `prompt`: the template a `--prompt` goes in: the format the run trained on;
//! - `bench`: decode steps timed on random weights of a named shape (`generate --bench`).
//!
//! For the training loop's `sample_every`: `greedy_text` runs on the training model as it is
//! (adapters unmerged, folded weights read through their views). Under FSDP the skeleton's
//! layers hold no weights: it refuses them (sample on a model whose layers are whole).

pub mod bench;
pub(crate) mod cache;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decoder;
#[cfg(feature = "cuda")]
mod graph;
pub mod load;
pub mod prompt;
pub(crate) mod sample;
pub mod stream;
pub(crate) mod weights;

pub use decoder::Decoder;
pub use sample::{Sampler, Sampling};
pub use weights::Weights;

use crate::data::TextTokenizer;
use crate::model::Model;
use anyhow::{bail, Result};
use std::time::Instant;

/// Lets the process's allocations on `device` skip cross-stream events (CUDA; a no-op
/// elsewhere). For processes that run on candle's one stream only, as `generate` does; never
/// inside training (its offload and NCCL streams need them).
pub fn single_stream(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    cuda::single_stream(device);
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// New tokens `sample_every` completions get.
pub const SAMPLE_MAX_NEW_TOKENS: usize = 64;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was picked (it is the output's last).
    Stop(u32),
    /// max_new_tokens were written.
    MaxNewTokens,
    /// The model's max_position_embeddings was reached.
    ContextFull,
}

/// One generation's tokens and timings.
#[derive(Debug, Clone)]
pub struct Output {
    /// The new tokens, a stop token included as the last.
    pub tokens: Vec<u32>,
    /// Why decoding stopped.
    pub finish: Finish,
    /// The prompt's forward and the first pick.
    pub prefill_s: f64,
    /// The rest.
    pub decode_s: f64,
}

impl Output {
    /// The new tokens without the stop token.
    pub fn text_tokens(&self) -> &[u32] {
        match self.finish {
            Finish::Stop(_) => &self.tokens[..self.tokens.len().saturating_sub(1)],
            _ => &self.tokens,
        }
    }
}

/// Up to `max_new` tokens after `prompt` (≥ 1 token): the cache keeps what it already holds
/// of the prompt (a chat's earlier turns). Stops after a token of `stop`. `on_token` sees each
/// token as it is picked.
pub fn generate(
    dec: &mut Decoder,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Output> {
    if prompt.is_empty() {
        bail!("the prompt is empty: nothing to continue");
    }
    let limit = dec.cache.limit();
    if prompt.len() >= limit {
        bail!(
            "the prompt has {} tokens; the model takes {limit} positions (max_position_embeddings)",
            prompt.len()
        );
    }
    let want = (prompt.len() + max_new).min(limit);
    dec.cache.reserve(want)?;
    let t0 = Instant::now();
    let mut tokens = Vec::with_capacity(max_new);
    let mut finish = Finish::MaxNewTokens;
    let mut prefill_s = 0.0;
    if max_new > 0 {
        let mut logits = dec.prime(prompt)?;
        loop {
            let tok = sampler.pick(&logits)?;
            if tokens.is_empty() {
                prefill_s = t0.elapsed().as_secs_f64();
            }
            tokens.push(tok);
            on_token(tok)?;
            if stop.contains(&tok) {
                finish = Finish::Stop(tok);
                break;
            }
            if tokens.len() >= max_new {
                break;
            }
            if dec.cache.len() + 1 > limit {
                finish = Finish::ContextFull;
                break;
            }
            logits = dec.extend(&[tok])?;
        }
    }
    let total = t0.elapsed().as_secs_f64();
    Ok(Output {
        tokens,
        finish,
        prefill_s,
        decode_s: total - prefill_s,
    })
}

/// Greedy tokens after `prompt` on `model` as it is (up to `max_new`, stopping after a token
/// of `stop`).
pub fn greedy_ids(model: &Model, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<Output> {
    let mut dec = Decoder::new(Weights::new(model)?, prompt.len() + max_new)?;
    let mut sampler = Sampler::new(Sampling::greedy())?;
    generate(&mut dec, prompt, max_new, stop, &mut sampler, &mut |_| {
        Ok(())
    })
}

/// The greedy completion of `prompt` (encoded with BOS as the tokenizer says, no EOS), up to
/// `max_new` tokens or a stop token (tokenizer_config.json's eos_token and the configs'
/// eos_token_id), as text without special tokens. For the training loop's `sample_every`.
pub fn greedy_text(
    model: &Model,
    tok: &TextTokenizer,
    prompt: &str,
    max_new: usize,
) -> Result<String> {
    let ids = tok.encode_prompt(prompt)?;
    let out = greedy_ids(model, &ids, max_new, &tok.stop_ids)?;
    tok.decode(out.text_tokens())
}

/// One line of samples.jsonl: a prompt's greedy completion at a step.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SampleRow {
    /// The training step it was sampled at.
    pub step: usize,
    pub(crate) prompt: String,
    /// The decoded completion.
    pub completion: String,
}

/// The greedy completions of `prompts` at `step` (`SAMPLE_MAX_NEW_TOKENS` each), for
/// `[train] sample_every`: the loop prints them and appends them to samples.jsonl.
pub fn sample_rows(
    model: &Model,
    tok: &TextTokenizer,
    step: usize,
    prompts: &[String],
) -> Result<Vec<SampleRow>> {
    prompts
        .iter()
        .map(|p| {
            Ok(SampleRow {
                step,
                prompt: p.clone(),
                completion: greedy_text(model, tok, p, SAMPLE_MAX_NEW_TOKENS)?,
            })
        })
        .collect()
}

/// Appends `rows` to `path` (samples.jsonl), one JSON object a line, each line whole.
pub fn append_samples(path: &std::path::Path, rows: &[SampleRow]) -> Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut text = String::new();
    for r in rows {
        text.push_str(&serde_json::to_string(r)?);
        text.push('\n');
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}
