//! Where a model runs and in what precision: the one resolution of (device kind, ordinal,
//! dtype) that `train`, `bench`, `probe`, `generate` and `export` share.

use crate::recipe::{DeviceKind, Dtype};
use anyhow::{Context, Result};
use candle_core::{DType, Device};

/// The base dtype of a model on `kind`: `dtype` when set, else f32 on the CPU and bf16 on CUDA.
pub fn dtype(kind: DeviceKind, dtype: Option<Dtype>) -> DType {
    match (dtype, kind) {
        (Some(d), _) => candle(d),
        (None, DeviceKind::Cpu) => DType::F32,
        (None, DeviceKind::Cuda) => DType::BF16,
    }
}

/// A recipe's dtype as candle's.
pub(crate) fn candle(d: Dtype) -> DType {
    match d {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
    }
}

/// A candle dtype as a recipe writes it (None: one a recipe cannot name).
pub(crate) fn recipe_dtype(d: DType) -> Option<Dtype> {
    match d {
        DType::F32 => Some(Dtype::F32),
        DType::BF16 => Some(Dtype::Bf16),
        DType::F16 => Some(Dtype::F16),
        _ => None,
    }
}

/// A CUDA device this machine lacks (`open`), or a binary built without CUDA.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The binary has no CUDA.
    #[error(
        "this binary was built without CUDA: {}; or run on the CPU",
        crate::util::CUDA_BUILD
    )]
    NoCuda,
    /// The ordinal is not one of this machine's devices.
    #[error("CUDA device {ordinal} does not exist: this machine has {count} ({})", ordinals(*count))]
    Missing {
        /// The ordinal asked for.
        ordinal: usize,
        /// The devices the driver reports.
        count: usize,
    },
}

fn ordinals(count: usize) -> String {
    match count {
        0 => "none".to_string(),
        n => format!("ordinals 0..{}", n - 1),
    }
}

/// The device of `kind`: the CPU, or CUDA device `ordinal` (checked to exist first).
pub fn open(kind: DeviceKind, ordinal: usize) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => {
            if !cfg!(feature = "cuda") {
                return Err(DeviceError::NoCuda.into());
            }
            if let Some(count) = cuda_count().filter(|&c| ordinal >= c) {
                return Err(DeviceError::Missing { ordinal, count }.into());
            }
            Device::new_cuda(ordinal).with_context(|| format!("cannot open CUDA device {ordinal}"))
        }
    }
}

/// How many CUDA devices the driver reports (None: no CUDA in this build, or no driver).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_count() -> Option<usize> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    CudaContext::device_count().ok().map(|c| c.max(0) as usize)
}

/// How many CUDA devices the driver reports (None: no CUDA in this build, or no driver).
#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_count() -> Option<usize> {
    None
}
