//! Differentiable building blocks that candle lacks or gets wrong for LoRA training.
//!
//! candle's fused `rms_norm`, `rope` and `softmax_last_dim` have no backward (the graph is cut
//! silently), and its matmul backward builds dW for every operand, frozen weights included.
//! Each op here is a `CustomOp1` over the activation alone: frozen tensors (weights, cos/sin,
//! masks) live inside the op, so backward never creates a gradient entry for them.
//!
//! Every op has a CPU implementation here, the reference the tests hold the GPU to (where an
//! op has none, the CPU takes another path: a composite of tensor ops, or `attention` for
//! `flash`); the `cuda` feature adds the kernels. Backward passes are ops of the same kind:
//! most have their own kernels (`rms_norm_bwd`, the GLU backward, attention's softmax
//! backward, fold's), the rest are composites of tensor ops.
//!
//! Which kernel runs where is decided once per run (`kernels::Kernels`, which the model holds
//! and each batch's `Ctx` carries); each op takes its choice from there. The CUDA sources are
//! the `.cu` files beside their ops, compiled once per process into one program (`cuda`).
//!
//! # The launch contract
//! What every CUDA launch in ops/ assumes, and where it is made to hold:
//! - **Layout.** Kernels read and write contiguous row-major buffers from a layout's start
//!   offset (`cuda::contiguous` refuses any other with an error; ops that take views call
//!   `.contiguous()` first). Only the cuBLAS GEMMs take strided operands, by leading dimension
//!   and batch stride.
//! - **Dtypes.** Activations are f32 or bf16 (`cuda::kernel` loads `<name>_f32` or
//!   `<name>_bf16` and refuses others); the operands of one launch share that dtype, checked
//!   before the launch. Ids and indices are u32, statistics (L, δ, norms, losses) f32.
//!   Vectorised kernels (8 bf16 or 4 values a thread) run only where every address is on
//!   their width and the row length divides; otherwise the scalar kernel, or `None` and the
//!   composite.
//! - **Stream.** Every launch, and every fresh output, goes on the stream of its inputs'
//!   device (candle's `cuda_stream()`), so it runs after the ops that wrote its inputs and
//!   before any op that reads its output. Nothing here launches on another stream (the few
//!   reads back to the host, such as `gemm_tune`'s timings, wait on this one).
//! - **Shapes.** A launcher checks what its operands tell it (element counts and dtypes
//!   against each other; grids within 2³² threads, `cuda::elems`) before launching. What only
//!   the caller knows (a weight of x's last dim, cos/sin [B, T, D/2], segment ids [B × T],
//!   targets < V, routing indices in range) is the caller's guarantee: kernels do not
//!   bounds-check indices. Each `// SAFETY:` line names which applies.
//! - **Fresh outputs** are allocated uninitialised; the kernel writes every element (a
//!   launcher that leaves any to its caller says so, e.g. padded rows).
//! - **Errors** (a refused layout, dtype or size, a failed load or launch) come back as
//!   `candle_core::Error` through the op to its caller, never a panic; a fault inside a kernel
//!   is asynchronous and surfaces at the next call that synchronises the stream.

pub(crate) mod add;
pub(crate) mod attach;
pub mod attention;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod dora;
pub mod dropout;
pub mod flash;
pub mod fold;
pub mod fold_drop;
pub(crate) mod frozen_linear;
#[cfg(feature = "cuda")]
pub(crate) mod gemm_tune;
pub mod glu;
pub mod grouped_mm;
pub mod kernels;
pub mod linear_acc;
pub(crate) mod lora_linear;
pub mod moe_rows;
pub(crate) mod multi_tensor;
pub mod oss_glu;
pub(crate) mod pool;
pub(crate) mod rms_norm;
pub(crate) mod rope;
pub(crate) mod softcap;

pub use add::add;
pub use attention::{attention, AttnMask};
pub use frozen_linear::frozen_linear;
pub use glu::swiglu;
pub use kernels::Kernels;
pub use lora_linear::lora_linear;
pub(crate) use rms_norm::NormSpec;
pub use rms_norm::{add_rms_norm, rms_norm};
pub use rms_norm::{rms_norm_bwd, rms_norm_bwd_add};
pub use rope::{rope, rope_heads, rope_rows_inv, to_heads, to_rows};

use candle_core::{CpuStorage, Layout, Result};

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(t: &candle_core::Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The contiguous slice of a CPU storage that `layout` describes, as f32 values.
/// Activations in bf16/f16 are widened once here; the math below runs in f32.
pub(crate) fn cpu_as_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("op input must be contiguous".into()))?;
    Ok(match s {
        CpuStorage::F32(v) => v[start..end].to_vec(),
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F64(v) => v[start..end].iter().map(|&x| x as f32).collect(),
        other => candle_core::bail!("unsupported dtype {:?} for a float op", other_dtype(other)),
    })
}

/// f32 values back into a CPU storage of the same dtype as `like`.
pub(crate) fn cpu_from_f32(v: Vec<f32>, like: &CpuStorage) -> Result<CpuStorage> {
    Ok(match like {
        CpuStorage::F32(_) => CpuStorage::F32(v),
        CpuStorage::BF16(_) => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        CpuStorage::F16(_) => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        CpuStorage::F64(_) => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
        other => candle_core::bail!("unsupported dtype {:?} for a float op", other_dtype(other)),
    })
}

/// Round an f32 to the storage's dtype and back, as a cast to the activation dtype would.
pub(crate) fn round_to(v: f32, s: &CpuStorage) -> f32 {
    match s {
        CpuStorage::BF16(_) => half::bf16::from_f32(v).to_f32(),
        CpuStorage::F16(_) => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn other_dtype(s: &CpuStorage) -> candle_core::DType {
    use candle_core::backend::BackendStorage;
    s.dtype()
}
