//! Our trainable decoder (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, qwen3_moe: one model,
//! the families' differences as data in model/family.rs), read from HF checkpoints.
//!
//! The model knows no communication and no optimiser: it maps token ids to hidden states and
//! logits, one decoder layer at a time, so the driver (train::driver) can checkpoint, recompute
//! and free memory between layers.

pub mod build;
pub mod check;
pub mod config;
mod config_rope;
pub mod decoder;
pub mod device;
pub mod family;
pub mod keep;
pub mod layer;
pub mod layer_mlp;
pub mod layer_moe;
pub mod layer_train;
pub mod linear;
pub mod moe_aux;
mod parts;
pub mod prefetch;
pub mod rope;
pub mod router;
pub mod shapes;

pub use config::{ConfigError, ModelConfig, RopeScaling};
pub use decoder::{Build, Ctx, Model};
pub use family::{Arch, Family, NormStyle};
pub use keep::{Keep, PARK_PENDING, PARK_TAIL};
pub use layer::{Extra, Layer, LayerSpec};
pub use layer_train::{LayerActs, LayerGrads, Retain};
pub use linear::{AdapterGrad, Linear, LoraGrad, Pad};
