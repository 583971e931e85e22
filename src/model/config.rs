//! The model's `config.json`, as written by transformers 4.x and 5.x.
//!
//! Field names moved between versions: `torch_dtype` became `dtype`; `rope_theta` and
//! `rope_scaling` moved into `rope_parameters` (Gemma 3: one entry per layer type);
//! `rope_scaling.type` became `rope_type`; `head_dim` may be absent or null; 5.x writes
//! `layer_types` where 4.x left the sliding layers to a rule of the family. We read what is
//! really there and name the file and the field when something is missing or not supported.
//! What differs between the families is resolved here into `Arch` (model/family.rs).

use super::config_rope::ropes;
use super::family::{Arch, Family, MoeSpec, NormStyle};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A config.json (or adapter_config.json) that cannot be used; the message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read model config {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid JSON, or a field missing, out of range or unsupported.
    #[error("model config {path}: {msg}")]
    Invalid {
        /// The config file.
        path: PathBuf,
        /// What is wrong, and the fix.
        msg: String,
    },
    /// A PEFT adapter_config.json (lora.init_adapter, or `export --adapter`).
    #[error("adapter config {path}: {msg}")]
    Adapter {
        /// The adapter_config.json.
        path: PathBuf,
        /// What is wrong, and the fix.
        msg: String,
    },
}

/// Rotary frequency scaling (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No scaling: the base frequencies.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor of every position.
        factor: f64,
    },
    /// Llama 3.1: per-frequency interpolation between low and high frequency bands.
    Llama3 {
        /// The divisor of the low-frequency band.
        factor: f64,
        /// Wavelengths longer than original_max_position / low_freq_factor take the whole
        /// `factor`.
        low_freq_factor: f64,
        /// Wavelengths shorter than original_max_position / high_freq_factor stay as they are;
        /// those between the two bands are interpolated.
        high_freq_factor: f64,
        /// The context the base was trained at (`original_max_position_embeddings`).
        original_max_position: usize,
    },
    /// Phi-3's LongRoPE ("su"): each frequency divided by its `short` factor, or by its `long`
    /// one for a batch whose positions reach past `original_max_position`; cos and sin × the
    /// attention factor.
    LongRope {
        /// Per frequency (D / 2 of them): its divisor while the positions stay within
        /// `original_max_position`.
        short: Vec<f64>,
        /// Per frequency: its divisor once they reach past it.
        long: Vec<f64>,
        /// The context the base was trained at (`original_max_position_embeddings`).
        original_max_position: usize,
        /// The factor cos and sin are multiplied by.
        attention_factor: f64,
    },
    /// YaRN (gpt-oss): each frequency blended between itself and itself ÷ `factor` by a
    /// linear ramp over the dimensions between the `beta_fast` and `beta_slow` rotation
    /// counts within `original_max_position`; cos and sin × the attention factor
    /// (model/yarn.rs, as transformers' `_compute_yarn_parameters`).
    Yarn {
        /// The context extension: the low frequencies' divisor.
        factor: f64,
        /// Rotations over `original_max_position` above which a frequency stays as it is (32).
        beta_fast: f64,
        /// Rotations below which it takes the whole `factor` (1).
        beta_slow: f64,
        /// The context the base was trained at (`original_max_position_embeddings`).
        original_max_position: usize,
        /// The ramp's ends floored and ceiled to whole dimensions (`truncate`, default true).
        truncate: bool,
        /// The factor cos and sin are multiplied by (`attention_factor`, else 0.1·ln(factor) + 1).
        attention_factor: f64,
    },
}

/// Everything the trainable model needs, resolved from config.json.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub(crate) family: Family,
    /// C: the width of the residual stream.
    pub hidden_size: usize,
    /// I: the width of a dense MLP's inner layer.
    pub intermediate_size: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub num_layers: usize,
    /// H: query heads.
    pub num_heads: usize,
    /// K: key/value heads (each serves H / K query heads; K < H is grouped-query attention).
    pub num_kv_heads: usize,
    /// D: the width of each head (`head_dim`, else C / H).
    pub head_dim: usize,
    /// V: the vocabulary (rows of the embedding and of the head).
    pub vocab_size: usize,
    pub(crate) rms_norm_eps: f64,
    /// The global RoPE (Gemma 3's sliding layers take `arch.local_rope`).
    pub(crate) rope_theta: f64,
    /// How the rotary frequencies are scaled for long contexts.
    pub rope_scaling: RopeScaling,
    /// The longest context the config declares (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// q/k/v projections carry a bias (Qwen2 always; Llama with `attention_bias`).
    pub(crate) qkv_bias: bool,
    /// o_proj carries a bias (Llama with `attention_bias`).
    pub(crate) o_bias: bool,
    /// gate/up/down carry a bias (Llama with `mlp_bias`).
    pub(crate) mlp_bias: bool,
    /// `tie_word_embeddings` as written; `None` when the config does not say.
    pub(crate) tie_word_embeddings: Option<bool>,
    /// The window of the sliding layers (`arch.sliding`); None when no layer slides.
    pub sliding_window: Option<usize>,
    pub(crate) bos_token_id: Option<u32>,
    /// The ids that end a sequence (`eos_token_id`: one or a list).
    pub eos_token_ids: Vec<u32>,
    pub(crate) pad_token_id: Option<u32>,
    /// `torch_dtype` / `dtype` as written (informational).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) stored_dtype: Option<String>,
    /// A bitsandbytes NF4 checkpoint (`quantization_config`): Some(double quant); None for a
    /// full-precision one (quant::bnb).
    pub(crate) bnb_nf4: Option<bool>,
    /// What the family changes in the layer (model/family.rs).
    pub arch: Arch,
}

#[derive(Deserialize)]
pub(super) struct Raw {
    pub(super) hidden_size: Option<usize>,
    pub(super) intermediate_size: Option<usize>,
    pub(super) num_hidden_layers: Option<usize>,
    pub(super) num_attention_heads: Option<usize>,
    pub(super) num_key_value_heads: Option<usize>,
    pub(super) head_dim: Option<usize>,
    pub(super) vocab_size: Option<usize>,
    pub(super) rms_norm_eps: Option<f64>,
    pub(super) rope_theta: Option<f64>,
    pub(super) rope_scaling: Option<Value>,
    pub(super) rope_parameters: Option<Value>,
    pub(super) rope_local_base_freq: Option<f64>,
    pub(super) partial_rotary_factor: Option<f64>,
    pub(super) original_max_position_embeddings: Option<usize>,
    pub(super) max_position_embeddings: Option<usize>,
    pub(super) hidden_act: Option<String>,
    pub(super) hidden_activation: Option<String>,
    pub(super) attention_bias: Option<bool>,
    pub(super) mlp_bias: Option<bool>,
    pub(super) tie_word_embeddings: Option<bool>,
    pub(super) sliding_window: Option<usize>,
    pub(super) use_sliding_window: Option<bool>,
    pub(super) max_window_layers: Option<usize>,
    pub(super) layer_types: Option<Vec<String>>,
    pub(super) sliding_window_pattern: Option<usize>,
    pub(super) query_pre_attn_scalar: Option<f64>,
    pub(super) bos_token_id: Option<Value>,
    pub(super) eos_token_id: Option<Value>,
    pub(super) pad_token_id: Option<Value>,
    pub(super) torch_dtype: Option<String>,
    pub(super) dtype: Option<String>,
    pub(super) num_experts: Option<usize>,
    pub(super) num_local_experts: Option<usize>,
    pub(super) num_experts_per_tok: Option<usize>,
    pub(super) moe_intermediate_size: Option<usize>,
    pub(super) norm_topk_prob: Option<bool>,
    pub(super) decoder_sparse_step: Option<usize>,
    pub(super) mlp_only_layers: Option<Vec<usize>>,
    pub(super) swiglu_limit: Option<f64>,
    pub(super) swiglu_alpha: Option<f64>,
}

impl ModelConfig {
    /// Reads and resolves the config.json at `path`; errors name the file and the field.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    pub(crate) fn from_json(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let err = |msg: String| ConfigError::Invalid {
            path: path.to_owned(),
            msg,
        };
        let json: Value = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        let Some(obj) = json.as_object() else {
            return Err(err("is not a JSON object".into()));
        };
        // The family first: another architecture's config is named as such, whatever else
        // it holds.
        let family = family_of(obj).map_err(err)?;
        let raw: Raw = serde_json::from_value(json.clone()).map_err(|e| err(e.to_string()))?;
        let need = |v: Option<usize>, name: &str| {
            v.filter(|&n| n > 0)
                .ok_or_else(|| err(format!("`{name}` is missing or 0")))
        };
        check_activation(family, &raw).map_err(err)?;
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let (num_kv_heads, head_dim) = head_shape(&raw, hidden_size, num_heads).map_err(err)?;

        let num_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        super::check::layers(num_layers, path)?;
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(4096);
        let (global, local) =
            ropes(family, &raw, max_position_embeddings, head_dim).map_err(err)?;
        let mut arch = Arch::of(family, num_layers);
        arch.local_rope = local;
        let sliding_window = raw.sliding_window.filter(|&w| w > 0);
        arch.sliding = sliding_layers(family, &raw, num_layers, sliding_window).map_err(err)?;
        let sliding_window = sliding_window.filter(|_| arch.sliding.iter().any(|&s| s));
        if family.gemma() {
            arch.query_pre_attn_scalar = Some(raw.query_pre_attn_scalar.unwrap_or(256.0));
            // Gemma 2 caps by default (50 and 30); `null` turns a cap off.
            let gemma2 = family == Family::Gemma2;
            arch.attn_softcap = cap(obj, "attn_logit_softcapping", gemma2.then_some(50.0));
            arch.final_softcap = cap(obj, "final_logit_softcapping", gemma2.then_some(30.0));
        }

        match family {
            Family::Qwen3Moe => arch.moe = Some(moe_spec(&raw, num_layers).map_err(err)?),
            Family::GptOss => arch.moe = Some(super::config_oss::moe_spec(&raw).map_err(err)?),
            _ => {}
        }

        // gpt-oss's projections carry biases unless config.json says otherwise
        let attention_bias = raw.attention_bias.unwrap_or(family == Family::GptOss);
        let (qkv_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Phi3 => (false, false),
            _ => (attention_bias, attention_bias),
        };
        let cfg = ModelConfig {
            family,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: global.theta,
            rope_scaling: global.scaling,
            max_position_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false) && family == Family::Llama,
            tie_word_embeddings: raw.tie_word_embeddings,
            sliding_window,
            bos_token_id: first_id(raw.bos_token_id.as_ref()),
            eos_token_ids: all_ids(raw.eos_token_id.as_ref()),
            pad_token_id: first_id(raw.pad_token_id.as_ref()),
            stored_dtype: raw.dtype.or(raw.torch_dtype),
            bnb_nf4: crate::quant::bnb::nf4_of(&json).map_err(|m| ConfigError::Invalid {
                path: path.to_owned(),
                msg: m,
            })?,
            arch,
        };
        super::check::config(&cfg, path)?;
        Ok(cfg)
    }

    /// The attention window of layer `l` (0: full attention).
    pub(crate) fn window(&self, l: usize) -> usize {
        match self.arch.sliding.get(l) {
            Some(true) => self.sliding_window.unwrap_or(0),
            _ => 0,
        }
    }

    /// The attention scores' scale: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2.
    pub(crate) fn attn_scale(&self) -> f64 {
        let q = self.arch.query_pre_attn_scalar;
        1.0 / q.unwrap_or(self.head_dim as f64).sqrt()
    }

    /// The embeddings' factor: √C on Gemma (the product then rounds it to the model dtype,
    /// as transformers' `embed_scale.to(weight.dtype)`), else none.
    pub(crate) fn embed_scale(&self) -> Option<f64> {
        self.arch
            .embed_scale
            .then(|| (self.hidden_size as f32).sqrt() as f64)
    }

    /// The RMSNorm settings of every norm of the model (eps, and Gemma's 1 + w gain).
    pub(crate) fn norm_spec(&self) -> crate::ops::NormSpec {
        crate::ops::NormSpec {
            eps: self.rms_norm_eps,
            offset: match self.arch.norm {
                NormStyle::Llama => 0.0,
                NormStyle::Gemma => 1.0,
            },
        }
    }

    /// What the kernel choices depend on (`ops::Kernels::resolve`).
    pub(crate) fn attn_shape(&self) -> crate::ops::kernels::AttnShape {
        crate::ops::kernels::AttnShape {
            head_dim: self.head_dim,
            softcap: self.arch.attn_softcap.is_some(),
            sinks: self.arch.sinks,
        }
    }

    /// The LoRA-targetable linears of a decoder layer, in checkpoint order.
    pub fn linears(&self) -> &'static [&'static str] {
        self.family.linears()
    }

    /// LoRA targets (names of `recipe::KNOWN_LINEAR`) as this model's linears, in its order,
    /// then the expert parameters named (a MoE's, `family::EXPERT_PARAMS`): all of them
    /// ("all-linear") become the family's linears alone (PEFT's "all-linear" takes no 3-D
    /// parameter); any other name must be one of the family's, else the error says which it
    /// has.
    pub(crate) fn resolve_targets(&self, targets: &[String]) -> Result<Vec<String>, String> {
        let experts: &[&str] = match self.arch.moe {
            Some(_) => &super::family::EXPERT_PARAMS,
            None => &[],
        };
        let own: Vec<&str> = self.linears().iter().chain(experts).copied().collect();
        let all = crate::recipe::KNOWN_LINEAR
            .iter()
            .all(|k| targets.iter().any(|t| t == k));
        let missing: Vec<&str> = targets
            .iter()
            .map(String::as_str)
            .filter(|t| !own.contains(t))
            .collect();
        if !all && !missing.is_empty() {
            let hint = match self.arch.fused {
                true => " (q, k and v are one projection there, gate and up another)",
                false => "",
            };
            return Err(format!(
                "names {}, which a {} model does not have{hint}; its linears: {}, or \"all-linear\"",
                missing.join(", "),
                self.family.model_type(),
                own.join(", ")
            ));
        }
        let named = |m: &str| targets.iter().any(|t| t == m);
        let linears = self.linears().iter().filter(|m| named(m));
        let experts = experts.iter().filter(|m| !all && named(m));
        Ok(linears.chain(experts).map(|m| m.to_string()).collect())
    }

    /// (in, out) of linear `module` of a decoder layer; None for a module it does not have.
    pub(crate) fn linear_shape(&self, module: &str) -> Option<(usize, usize)> {
        let (c, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let s = match module {
            "q_proj" => (c, q),
            "k_proj" | "v_proj" => (c, kv),
            "qkv_proj" => (c, q + 2 * kv),
            "o_proj" => (q, c),
            "gate_proj" | "up_proj" => (c, i),
            "gate_up_proj" => (c, 2 * i),
            "down_proj" => (i, c),
            _ => return None,
        };
        self.linears().contains(&module).then_some(s)
    }

    /// Norm gains of one decoder layer: (count, width) pairs.
    pub(crate) fn layer_norms(&self) -> Vec<(usize, usize)> {
        let mut v = vec![(2, self.hidden_size)];
        if self.arch.sandwich_norms {
            v.push((2, self.hidden_size));
        }
        if self.arch.qk_norm {
            v.push((2, self.head_dim));
        }
        v
    }

    /// Parameters of the frozen base, for reports and memory plans.
    pub(crate) fn num_params(&self, tied: bool) -> usize {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let linears: usize = self
            .linears()
            .iter()
            .filter_map(|m| self.linear_shape(m))
            .map(|(i, o)| i * o)
            .sum();
        let biases = match (self.qkv_bias, self.o_bias) {
            (true, o) => (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + o as usize * h,
            (false, true) => h,
            (false, false) => 0,
        } + if self.mlp_bias {
            2 * self.intermediate_size + h
        } else {
            0
        };
        let norms: usize = self.layer_norms().iter().map(|(n, w)| n * w).sum();
        // a MoE layer's experts (gate_up [E, 2I, C], down [E, C, I]) and router [E, C]
        let experts = self.arch.moe.map_or(0, |m| {
            // gpt-oss: the router's bias [E], the experts' [E, 2I] and [E, C]
            let oss = m.oss.map_or(0, |_| 1 + 2 * m.inter + h);
            m.experts * (3 * m.inter * h + h + oss)
        });
        let sinks = self.arch.sinks as usize * self.num_heads;
        let per_layer = linears + biases + norms + experts + sinks;
        v * h * if tied { 1 } else { 2 } + self.num_layers * per_layer + h
    }
}

/// The kv head count and the head dim: `num_key_value_heads` (default: every head's own)
/// dividing the heads, `head_dim` (default: hidden / heads, which must divide) even for RoPE.
fn head_shape(raw: &Raw, hidden: usize, heads: usize) -> Result<(usize, usize), String> {
    let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(format!(
            "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        ));
    }
    let head_dim = match raw.head_dim {
        Some(d) if d > 0 => d,
        _ if hidden % heads != 0 => {
            return Err(format!(
                "hidden_size {hidden} is not divisible by num_attention_heads {heads} and `head_dim` is not set"
            ))
        }
        _ => hidden / heads,
    };
    if head_dim % 2 != 0 {
        return Err(format!(
            "head_dim {head_dim} must be even for rotary embeddings"
        ));
    }
    Ok((kv_heads, head_dim))
}

/// config.json's family, or why it is not one we train (naming its model_type and ours).
fn family_of(obj: &Map<String, Value>) -> Result<Family, String> {
    let t = match obj.get("model_type") {
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err("`model_type` is not a string".into()),
        None => {
            return Err(format!(
                "`model_type` is missing; supported: {}",
                Family::supported_list()
            ))
        }
    };
    if let Some(f) = Family::of(t) {
        return Ok(f);
    }
    let why = match t {
        "gemma3" => " (a Gemma 3 vision-language checkpoint; lora-train trains text models: \
                     Gemma 3's text model alone is `gemma3_text`, e.g. google/gemma-3-1b-it)"
            .to_string(),
        _ if obj.contains_key("text_config") || obj.contains_key("vision_config") => {
            " (a vision-language checkpoint: lora-train trains text models)".to_string()
        }
        _ => String::new(),
    };
    Err(format!(
        "model_type `{t}` is not supported{why}; supported: {}",
        Family::supported_list()
    ))
}

/// A Qwen3-MoE config's experts: transformers 5 writes `num_local_experts`, 4.x (and the Hub's
/// checkpoints) `num_experts`. Every layer's MLP must be sparse.
fn moe_spec(raw: &Raw, layers: usize) -> Result<MoeSpec, String> {
    let experts = raw
        .num_experts
        .or(raw.num_local_experts)
        .filter(|&e| e > 0)
        .ok_or("`num_experts` (or `num_local_experts`) is missing or 0")?;
    let top_k = raw.num_experts_per_tok.unwrap_or(8);
    if top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok {top_k} must be in 1..={experts} (num_experts)"
        ));
    }
    let inter = raw
        .moe_intermediate_size
        .filter(|&i| i > 0)
        .ok_or("`moe_intermediate_size` is missing or 0")?;
    let step = raw.decoder_sparse_step.unwrap_or(1);
    let dense = raw.mlp_only_layers.as_deref().unwrap_or(&[]);
    if step != 1 || dense.iter().any(|&l| l < layers) {
        return Err(format!(
            "decoder_sparse_step = {step}, mlp_only_layers = {dense:?}: dense MLP layers in a \
             qwen3_moe model are not supported (every layer must be sparse: step 1, no \
             mlp_only_layers)"
        ));
    }
    Ok(MoeSpec {
        experts,
        top_k,
        inter,
        norm_topk: raw.norm_topk_prob.unwrap_or(true),
        oss: None,
    })
}

/// The MLP activation must be the family's: SiLU, or GeLU (tanh) for Gemma.
fn check_activation(family: Family, raw: &Raw) -> Result<(), String> {
    let (key, act, want) = if family.gemma() {
        match (&raw.hidden_activation, &raw.hidden_act) {
            (Some(a), _) => ("hidden_activation", Some(a), "gelu_pytorch_tanh"),
            (None, a) => ("hidden_act", a.as_ref(), "gelu_pytorch_tanh"),
        }
    } else {
        ("hidden_act", raw.hidden_act.as_ref(), "silu")
    };
    match act {
        Some(a) if a != want => Err(format!(
            "{key} `{a}` is not supported for {} (only {want})",
            family.model_type()
        )),
        _ => Ok(()),
    }
}

/// A soft-cap of config.json: absent → the family's default, null → none, else its value.
fn cap(obj: &Map<String, Value>, key: &str, default: Option<f64>) -> Option<f64> {
    match obj.get(key) {
        None => default,
        Some(v) => v.as_f64(),
    }
}

/// Per layer, whether it attends within the sliding window: config.json's `layer_types` where
/// it has them (transformers 5), else the family's rule as transformers applies it.
fn sliding_layers(
    family: Family,
    raw: &Raw,
    layers: usize,
    window: Option<usize>,
) -> Result<Vec<bool>, String> {
    let v: Vec<bool> = match &raw.layer_types {
        Some(types) => {
            if types.len() != layers {
                return Err(format!(
                    "`layer_types` has {} entries for num_hidden_layers = {layers}",
                    types.len()
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(false),
                    "sliding_attention" => Ok(true),
                    other => Err(format!(
                        "`layer_types` holds `{other}`; supported: full_attention, sliding_attention"
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        None => (0..layers)
            .map(|i| match family {
                Family::Llama => false,
                Family::Mistral | Family::Phi3 => window.is_some(),
                Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe => {
                    raw.use_sliding_window == Some(true)
                        && window.is_some()
                        && i >= raw.max_window_layers.unwrap_or(28)
                }
                Family::Gemma2 | Family::GptOss => i % 2 == 0,
                Family::Gemma3 => (i + 1) % raw.sliding_window_pattern.unwrap_or(6).max(1) != 0,
            })
            .collect(),
    };
    // Qwen's sliding layers need use_sliding_window (transformers drops the window otherwise).
    let qwen_off = matches!(family, Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe)
        && raw.use_sliding_window != Some(true);
    if qwen_off {
        return Ok(vec![false; layers]);
    }
    if v.iter().any(|&s| s) && window.is_none() {
        return Err("sliding-window layers but `sliding_window` is not set".into());
    }
    Ok(v)
}

fn first_id(v: Option<&Value>) -> Option<u32> {
    all_ids(v).first().copied()
}

fn all_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| x as u32).into_iter().collect(),
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
            "num_attention_heads":4,"vocab_size":9,"rope_scaling":{"rope_type":"fope","factor":4.0}}"#;
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains("`fope` is not supported"), "{e}");
    }

    /// kv heads default to the heads and must divide them; head_dim defaults to hidden / heads
    /// (which must divide unless head_dim is set), and is even for RoPE.
    #[test]
    fn head_shape_defaults_and_refusals() {
        let cfg = |heads: usize, extra: &str| {
            parse(&format!(
                r#"{{"model_type":"llama","hidden_size":60,"intermediate_size":8,
                "num_hidden_layers":1,"num_attention_heads":{heads},"vocab_size":9{extra}}}"#
            ))
        };
        let c = cfg(6, "").unwrap();
        assert_eq!((c.num_kv_heads, c.head_dim), (6, 10));
        let c = cfg(6, r#","num_key_value_heads":2,"head_dim":24"#).unwrap();
        assert_eq!((c.num_kv_heads, c.head_dim), (2, 24));
        for (heads, extra, want) in [
            (
                6,
                r#","num_key_value_heads":4"#,
                "6 is not a multiple of num_key_value_heads 4",
            ),
            (
                6,
                r#","num_key_value_heads":0"#,
                "not a multiple of num_key_value_heads 0",
            ),
            (7, "", "not divisible by num_attention_heads 7"),
            (6, r#","head_dim":9"#, "head_dim 9 must be even"),
            (12, "", "head_dim 5 must be even"),
        ] {
            let e = cfg(heads, extra).unwrap_err().to_string();
            assert!(e.contains(want), "{heads} {extra}: {e}");
        }
    }

    #[test]
    fn qwen3_moe_reads_its_experts_and_names_what_it_refuses() {
        let base = r#""model_type":"qwen3_moe","hidden_size":32,"intermediate_size":48,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,
            "vocab_size":100,"moe_intermediate_size":24,"num_experts_per_tok":2"#;
        // 4.x (and the Hub) write num_experts, transformers 5 num_local_experts
        for experts in [r#""num_experts":8"#, r#""num_local_experts":8"#] {
            let c = parse(&format!("{{{base},{experts}}}")).unwrap();
            let m = c.arch.moe.unwrap();
            assert_eq!((m.experts, m.top_k, m.inter, m.norm_topk), (8, 2, 24, true));
            assert!(c.arch.qk_norm);
            // all-linear is PEFT's: the attention alone; the experts when named
            let all: Vec<String> = crate::recipe::KNOWN_LINEAR.map(String::from).to_vec();
            assert_eq!(c.resolve_targets(&all).unwrap(), c.linears().to_vec());
            let named = vec!["mlp.experts.down_proj".to_string(), "q_proj".into()];
            assert_eq!(
                c.resolve_targets(&named).unwrap(),
                ["q_proj", "mlp.experts.down_proj"]
            );
            let dense = vec!["gate_proj".to_string()];
            let e = c.resolve_targets(&dense).unwrap_err();
            assert!(e.contains("mlp.experts.gate_up_proj"), "{e}");
        }
        let e = parse(&format!(
            "{{{base},\"num_experts\":8,\"mlp_only_layers\":[1]}}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("mlp_only_layers = [1]"), "{e}");
        let e = parse(&format!("{{{base}}}")).unwrap_err().to_string();
        assert!(e.contains("`num_experts`"), "{e}");
        // a llama config names no experts there
        let l = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#;
        let c = parse(l).unwrap();
        let e = c
            .resolve_targets(&["mlp.experts.down_proj".to_string()])
            .unwrap_err();
        assert!(e.contains("does not have"), "{e}");
    }
}
