//! `[lora]`: the adapters.

use serde::{de, Deserialize, Deserializer, Serialize};
use std::path::PathBuf;

/// Every module name lora.targets may hold: Llama's seven, then Phi-3's fused projections (each
/// family has its own subset: model/family.rs), then a MoE's expert parameters as PEFT's
/// `target_parameters` names them. "all-linear" is all of them, which a model resolves to its
/// own linears (as PEFT's "all-linear", not the experts). The order is the checkpoint's, and a
/// module's index here keys its adapter's random streams (model::module_index).
pub(crate) const KNOWN_LINEAR: [&str; 11] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
];

/// `[lora]`: the adapters.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LoraSection {
    /// Adapter rank r. Default: 8.
    #[serde(default = "d_rank")]
    pub(crate) rank: usize,
    /// Scale numerator: scale = alpha / r (alpha / √r with rslora). Default: 16.
    #[serde(default = "d_alpha")]
    pub(crate) alpha: f64,
    /// Dropout on the adapter input, in [0, 1). Default: 0.
    #[serde(default)]
    pub(crate) dropout: f64,
    /// Module names to adapt (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; Phi-3's
    /// qkv_proj o_proj gate_up_proj down_proj), or "all-linear" for all of the model's.
    /// Default: ["q_proj", "v_proj"] (PEFT's Llama default).
    #[serde(default = "d_targets")]
    pub(crate) targets: Targets,
    /// rsLoRA scaling alpha / √r. Default: false.
    #[serde(default)]
    pub(crate) rslora: bool,
    /// DoRA (PEFT's `use_dora`): each adapter also trains a magnitude per output row,
    /// y = (m / ‖W + s·B A‖_row) ⊙ (x Wᵀ + s·x Aᵀ Bᵀ) + bias. Needs dropout = 0; not with
    /// FSDP or train.sample_every. Default: false.
    #[serde(default)]
    pub(crate) use_dora: bool,
    /// A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    /// from. Its r, lora_alpha, target_modules and use_rslora replace the values above
    /// (`dropout` still comes from this recipe).
    pub(crate) init_adapter: Option<PathBuf>,
}

fn d_rank() -> usize {
    8
}
fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Targets {
    Targets::List(vec!["q_proj".into(), "v_proj".into()])
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: d_rank(),
            alpha: d_alpha(),
            dropout: 0.0,
            targets: d_targets(),
            rslora: false,
            use_dora: false,
            init_adapter: None,
        }
    }
}

/// `lora.targets`: a list of module names or "all-linear".
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub(crate) enum Targets {
    AllLinear(String),
    List(Vec<String>),
}

impl<'de> Deserialize<'de> for Targets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Targets;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of module names or \"all-linear\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Targets, E> {
                if s == "all-linear" || s == "all" {
                    Ok(Targets::AllLinear("all-linear".into()))
                } else {
                    Err(E::custom(format!(
                        "expected a list of module names or \"all-linear\", found \"{s}\""
                    )))
                }
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Targets, A::Error> {
                let mut v = Vec::new();
                while let Some(s) = a.next_element::<String>()? {
                    v.push(s);
                }
                Ok(Targets::List(v))
            }
        }
        d.deserialize_any(V)
    }
}
