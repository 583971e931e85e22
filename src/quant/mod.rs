//! The frozen base quantized (QLoRA): bitsandbytes' NF4 format, made at load or read from a
//! pre-quantized checkpoint, and dequantized just in time for each layer's GEMMs.

pub mod dynamic;
pub mod nf4;

pub use nf4::Nf4;

/// `[model] quantize`: how the frozen linears of the decoder layers are stored (`Nf4` is
/// refused by `Recipe::validate` until an NF4 base loads, trains and exports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    /// In the base dtype.
    #[default]
    None,
    /// bitsandbytes' NF4 (`nf4`), dequantized to the base dtype just in time for each layer.
    Nf4,
}
