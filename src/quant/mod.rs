//! The frozen base quantized (QLoRA): bitsandbytes' NF4 format, made at load or read from a
//! pre-quantized checkpoint, and dequantized just in time for each layer's GEMMs.

pub mod dynamic;
pub mod nf4;

pub use nf4::Nf4;
