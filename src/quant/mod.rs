//! The frozen base quantized (QLoRA): bitsandbytes' NF4 format, made at load or read from a
//! pre-quantized checkpoint, and dequantized just in time for each layer's GEMMs.

pub mod bnb;
pub mod dynamic;
pub mod nf4;
pub mod slabs;
pub mod weight;

pub use nf4::Nf4;
pub use slabs::Slabs;
pub use weight::QWeight;

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

/// How a run stores its frozen base (`[model] quantize`, `double_quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quant {
    pub kind: Quantize,
    /// NF4's absmax double-quantized.
    pub double_quant: bool,
}

impl Quant {
    /// The base as it is.
    pub const NONE: Quant = Quant {
        kind: Quantize::None,
        double_quant: false,
    };

    pub fn is_nf4(&self) -> bool {
        self.kind == Quantize::Nf4
    }

    /// The storage of a checkpoint's base (`config`: its config.json): NF4 as the checkpoint
    /// has it when it is a bitsandbytes 4-bit one (whatever `self` asks), else `self`.
    pub fn for_checkpoint(self, config: &std::path::Path) -> anyhow::Result<Quant> {
        Ok(match bnb::nf4_config(config)? {
            Some(double_quant) => Quant {
                kind: Quantize::Nf4,
                double_quant,
            },
            None => self,
        })
    }
}
