//! The frozen base quantized (QLoRA): bitsandbytes' NF4 format, made at load or read from a
//! pre-quantized checkpoint, and dequantized just in time for each layer's GEMMs; and gpt-oss's
//! MXFP4 experts as the Hub stores them, dequantized exactly as they load (`mxfp4`).

pub mod bnb;
pub mod dynamic;
pub mod experts;
pub mod mxfp4;
pub mod nf4;
pub(crate) mod slabs;
pub(crate) mod weight;

pub use experts::ExpertsNf4;
pub use nf4::Nf4;
pub(crate) use slabs::Slabs;
pub use weight::QWeight;

/// How a run stores its frozen base (`[model] quantize`, `double_quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quant {
    /// The decoder linears and a MoE's routed experts in bitsandbytes' NF4, dequantized just
    /// in time for each layer (the experts a tile at a time, `experts`).
    pub nf4: bool,
    /// NF4's absmax double-quantized.
    pub double_quant: bool,
}

impl Quant {
    /// The base as it is.
    pub(crate) const NONE: Quant = Quant {
        nf4: false,
        double_quant: false,
    };

    /// NF4, its absmax double-quantized or not.
    pub(crate) fn nf4(double_quant: bool) -> Quant {
        Quant {
            nf4: true,
            double_quant,
        }
    }

    /// Whether the decoder linears (and a MoE's experts) are NF4.
    pub(crate) fn is_nf4(&self) -> bool {
        self.nf4
    }

    /// The storage of a checkpoint's base (`config`: its config.json): NF4 as the checkpoint
    /// has it when it is a bitsandbytes 4-bit one (whatever `self` asks), else `self`.
    pub fn for_checkpoint(self, config: &std::path::Path) -> anyhow::Result<Quant> {
        Ok(match bnb::nf4_config(config)? {
            Some(double_quant) => Quant::nf4(double_quant),
            None => self,
        })
    }
}
