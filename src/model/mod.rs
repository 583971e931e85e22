//! Our trainable Llama-family model (llama, mistral, qwen2), read from HF checkpoints.
//!
//! The model knows no communication and no optimiser: it maps token ids to hidden states and
//! logits, one decoder layer at a time, so the driver (train::driver) can checkpoint, recompute
//! and free memory between layers.

pub mod check;
pub mod config;
pub mod layer;
pub mod layer_train;
pub mod linear;
pub mod llama;
pub mod prefetch;
pub mod rope;

pub use config::{ConfigError, Family, ModelConfig, RopeScaling};
pub use layer::Layer;
pub use layer_train::{LayerActs, LayerGrads};
pub use linear::{AdapterGrad, Linear, Pad};
pub use llama::{Ctx, Model};
