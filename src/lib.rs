//! lora-train: LoRA fine-tuning of Hugging Face Llama-family checkpoints on candle.
//!
//! Data path, one module each: recipe → hub → model → lora → data → train → export.

pub mod bench;
pub mod data;
pub mod export;
pub mod generate;
pub mod hub;
pub mod lora;
pub mod memory;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod probe;
pub mod recipe;
pub mod report;
pub mod rng;
pub mod train;
pub mod util;
