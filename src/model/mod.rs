//! Our trainable decoder (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, qwen3_moe,
//! gpt_oss: one model,
//! the families' differences as data in model/family.rs), read from HF checkpoints.
//!
//! The model knows no communication and no optimiser: it maps token ids to hidden states and
//! logits, one decoder layer at a time, so the driver (train::driver) can checkpoint, recompute
//! and free memory between layers.

pub mod adapter;
pub(crate) mod build;
pub(crate) mod check;
pub(crate) mod config;
mod config_oss;
mod config_rope;
pub mod decoder;
pub mod device;
pub(crate) mod family;
pub(crate) mod keep;
pub(crate) mod layer;
pub(crate) mod layer_mlp;
pub(crate) mod layer_moe;
pub(crate) mod layer_train;
pub(crate) mod linear;
pub(crate) mod moe_aux;
mod moe_tiles;
mod parts;
pub(crate) mod prefetch;
pub mod rope;
pub(crate) mod router;
pub mod shapes;
mod yarn;

pub use adapter::{module_index, Inject, Lora};
pub use config::{ConfigError, ModelConfig, RopeScaling};
pub(crate) use decoder::Ctx;
pub use decoder::{Build, Model};
pub(crate) use family::Family;
pub use family::{ALL_LINEAR, EXPERT_PARAMS};
pub use keep::Keep;
pub(crate) use keep::{PARK_PENDING, PARK_TAIL};
pub use layer::Layer;
pub(crate) use layer::LayerSpec;
pub(crate) use layer_train::LayerActs;
pub use layer_train::{LayerGrads, Retain};
pub use linear::Linear;
pub use router::routing_reads;
