//! `[model]`: which checkpoint, in which precision, where.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The base's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

/// Where a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The host's cores.
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
}

impl DeviceKind {
    /// Whether it is CUDA.
    pub fn is_cuda(self) -> bool {
        self == DeviceKind::Cuda
    }
}

/// `[model]`: which checkpoint, in which precision, where.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Local Hugging Face checkpoint directory (config.json + safetensors). One of path / id.
    pub path: Option<PathBuf>,
    /// Hub repository id, e.g. "meta-llama/Llama-2-7b-hf". One of path / id.
    pub id: Option<String>,
    /// Hub revision (branch, tag or commit). Default: "main".
    pub revision: Option<String>,
    /// Base weight precision: "f32" | "bf16" | "f16". Default: "f32" on the CPU, "bf16" on CUDA.
    /// Adapters and optimiser state are always f32.
    pub dtype: Option<Dtype>,
    /// "cpu" | "cuda". Default: "cpu".
    #[serde(default = "default_device")]
    pub device: DeviceKind,
    /// The frozen linears of the decoder layers in 4 bits (QLoRA): "nf4" (bitsandbytes' NF4,
    /// quantized layer by layer as the checkpoint loads, dequantized just in time for each
    /// layer's GEMMs) | "none". Default: "none". Under FSDP each rank keeps 1/N of it in NF4.
    #[serde(default)]
    pub(crate) quantize: Quantize,
    /// With quantize = "nf4": the absmax values quantized again to 8 bits in blocks of 256
    /// (bitsandbytes' `bnb_4bit_use_double_quant`), 0.37 fewer bits a weight. Default: true.
    #[serde(default = "super::d_true")]
    pub(crate) double_quant: bool,
}

fn default_device() -> DeviceKind {
    DeviceKind::Cpu
}

/// `[model] quantize`: how the frozen linears of the decoder layers are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    /// In the base dtype.
    #[default]
    None,
    /// bitsandbytes' NF4 (`nf4`), dequantized to the base dtype just in time for each layer.
    Nf4,
}
