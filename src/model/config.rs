//! The model's `config.json`, as written by transformers 4.x and 5.x.
//!
//! Field names moved between versions: `torch_dtype` became `dtype`; `rope_theta` and
//! `rope_scaling` moved into `rope_parameters`; `rope_scaling.type` became `rope_type`;
//! `head_dim` may be absent or null. We read what is really there and name the file and the
//! field when something is missing or not supported.

use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read model config {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("model config {path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    /// A PEFT adapter_config.json (lora.init_adapter, or `export --adapter`).
    #[error("adapter config {path}: {msg}")]
    Adapter { path: PathBuf, msg: String },
}

/// Which Llama-family architecture the checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
}

/// Rotary frequency scaling (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1: per-frequency interpolation between low and high frequency bands.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    },
}

/// Everything the trainable model needs, resolved from config.json.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    /// q/k/v projections carry a bias (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// gate/up/down carry a bias (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// `tie_word_embeddings` as written; `None` when the config does not say.
    pub tie_word_embeddings: Option<bool>,
    /// Attention window for Mistral-style sliding-window attention (None = full).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// `torch_dtype` / `dtype` as written (informational).
    pub stored_dtype: Option<String>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    pad_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    pub fn from_json(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let err = |msg: String| ConfigError::Invalid {
            path: path.to_owned(),
            msg,
        };
        let raw: Raw = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        let need = |v: Option<usize>, name: &str| {
            v.filter(|&n| n > 0)
                .ok_or_else(|| err(format!("`{name}` is missing or 0")))
        };
        let family = match raw.model_type.as_deref() {
            Some("llama") => Family::Llama,
            Some("mistral") => Family::Mistral,
            Some("qwen2") => Family::Qwen2,
            Some(other) => {
                return Err(err(format!(
                    "model_type `{other}` is not supported; supported: llama, mistral, qwen2"
                )))
            }
            None => return Err(err("`model_type` is missing".into())),
        };
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(err(format!(
                    "hidden_act `{act}` is not supported (only silu)"
                )));
            }
        }
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(err(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) if d > 0 => d,
            _ => {
                if hidden_size % num_heads != 0 {
                    return Err(err(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} and `head_dim` is not set"
                    )));
                }
                hidden_size / num_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(err(format!(
                "head_dim {head_dim} must be even for rotary embeddings"
            )));
        }

        // transformers 5 keeps theta and scaling in `rope_parameters`; 4.x at the top level.
        let params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
        let rope_theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(raw.rope_theta)
            .unwrap_or(if family == Family::Qwen2 {
                1_000_000.0
            } else {
                10_000.0
            });
        let scaling_src = match (params, raw.rope_scaling.as_ref().filter(|v| v.is_object())) {
            (_, Some(s)) => Some(s),
            (Some(p), None) => Some(p),
            (None, None) => None,
        };
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(4096);
        let rope_scaling = match scaling_src {
            None => RopeScaling::None,
            Some(s) => parse_scaling(s, max_position_embeddings).map_err(err)?,
        };

        let attention_bias = raw.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let sliding_window = match family {
            Family::Mistral => raw.sliding_window,
            Family::Qwen2 if raw.use_sliding_window == Some(true) => raw.sliding_window,
            _ => None,
        };
        let cfg = ModelConfig {
            family,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            tie_word_embeddings: raw.tie_word_embeddings,
            sliding_window,
            bos_token_id: first_id(raw.bos_token_id.as_ref()),
            eos_token_ids: all_ids(raw.eos_token_id.as_ref()),
            pad_token_id: first_id(raw.pad_token_id.as_ref()),
            stored_dtype: raw.dtype.or(raw.torch_dtype),
        };
        super::check::config(&cfg, path)?;
        Ok(cfg)
    }

    /// Parameters of the frozen base, for reports and memory plans.
    pub fn num_params(&self, tied: bool) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let attn = h * q + 2 * h * kv + q * h;
        let per_layer = attn + 3 * h * i + 2 * h;
        v * h * if tied { 1 } else { 2 } + self.num_layers * per_layer + h
    }
}

fn parse_scaling(s: &Value, max_pos: usize) -> Result<RopeScaling, String> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str| s.get(k).and_then(Value::as_f64);
    let factor = || f("factor").ok_or_else(|| format!("rope scaling `{kind}` needs `factor`"));
    match kind {
        "default" => Ok(RopeScaling::None),
        // Dynamic NTK only changes frequencies past max_position_embeddings at inference.
        "dynamic" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
            original_max_position: s
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .unwrap_or(max_pos),
        }),
        other => Err(format!(
            "rope scaling type `{other}` is not supported (supported: default, linear, dynamic, llama3)"
        )),
    }
}

fn first_id(v: Option<&Value>) -> Option<u32> {
    all_ids(v).first().copied()
}

fn all_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ModelConfig, ConfigError> {
        ModelConfig::from_json(s, Path::new("config.json"))
    }

    #[test]
    fn reads_transformers4_and_5_rope_fields() {
        let v4 = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,"rope_theta":500000.0,
            "rope_scaling":{"type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192},"torch_dtype":"bfloat16"}"#;
        let v5 = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,
            "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},
            "dtype":"bfloat16","head_dim":null}"#;
        for c in [parse(v4).unwrap(), parse(v5).unwrap()] {
            assert_eq!(c.rope_theta, 500000.0);
            assert_eq!(
                c.rope_scaling,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position: 8192
                }
            );
            assert_eq!(c.head_dim, 16);
            assert_eq!(c.num_kv_heads, 4);
            assert_eq!(c.stored_dtype.as_deref(), Some("bfloat16"));
        }
    }

    #[test]
    fn qwen2_has_qkv_bias_and_errors_name_the_field() {
        let q = r#"{"model_type":"qwen2","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "eos_token_id":[5,6]}"#;
        let c = parse(q).unwrap();
        assert!(c.qkv_bias && !c.o_bias);
        assert_eq!(c.eos_token_ids, vec![5, 6]);
        let bad = r#"{"model_type":"gpt2","hidden_size":64}"#;
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains("model_type `gpt2` is not supported"), "{e}");
        let bad = r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":3}"#;
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains("not a multiple of num_key_value_heads 3"), "{e}");
        let bad = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":4,"vocab_size":9,"rope_scaling":{"rope_type":"yarn","factor":4.0}}"#;
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains("`yarn` is not supported"), "{e}");
    }
}
