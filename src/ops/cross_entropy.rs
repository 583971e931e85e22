//! The training head's token cross-entropy and its gradient in one go, without autograd:
//! logits [n, V], targets [n] u32 → (ce [n] f32 = lse − logit[target] per row,
//! dL/dlogits [n, V] = (softmax − onehot) / denom in the logits' dtype), for L = Σ ce / denom.
//!
//! Math is f32 throughout (logits upcast when read, as transformers' `logits.float()`), the
//! gradient rounded once to the logits' dtype. As tensor ops this is about a dozen kernels per
//! chunk of rows, each reading or writing an [n, V] f32 buffer (the cast, max, sub, exp, sum,
//! mul, scatter_add, the cast back), with three such buffers alive at once. On CUDA (f32 or
//! bf16, contiguous logits: `CrossEntropy::Fused`) `cross_entropy.cu` does it in one kernel: two
//! reads of the logits in their own dtype and one write of the gradient, nothing [n, V] in f32.
//! The tensor ops stay as `cross_entropy_fwd_bwd_ops`: the reference, and the path everywhere
//! else (CPU, f16).
//!
//! The caller guarantees every target < V (the data pipeline validates token ids): the kernel
//! reads logit[target] unchecked, and a check here would cost a device-to-host sync.

use super::kernels::CrossEntropy;
use candle_core::{DType, Result, Tensor};

/// logits [n, V] (activation dtype), targets [n] u32 → (ce [n] f32, dL/dlogits [n, V] in the
/// logits' dtype) for L = Σ ce / `denom`. The fused kernel where `kind` is `Fused` and it takes
/// the operands (`kernel_takes`), the tensor ops elsewhere. With `softcap` (Gemma 2's final
/// logit soft-cap) the CE is of cap · tanh(logits / cap) and the gradient is back through it:
/// inside the kernel (no capped [n, V] copy, no pass of its own), else `ops::softcap` around the
/// tensor ops.
pub fn cross_entropy_fwd_bwd(
    logits: &Tensor,
    targets: &Tensor,
    denom: f64,
    softcap: Option<f64>,
    kind: CrossEntropy,
) -> Result<(Tensor, Tensor)> {
    let (n, _) = logits.dims2()?;
    if targets.dims() != [n] {
        candle_core::bail!(
            "cross_entropy: targets {:?} for logits {:?} (want [n] targets for [n, V] logits)",
            targets.dims(),
            logits.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if kind == CrossEntropy::Fused && kernel_takes(logits, targets) {
        return imp::fwd_bwd(logits, targets, denom, softcap.unwrap_or(0.0));
    }
    let _ = kind;
    let Some(cap) = softcap else {
        return cross_entropy_fwd_bwd_ops(logits, targets, denom);
    };
    let z = super::softcap::softcap(logits, cap)?;
    let (ce, dz) = cross_entropy_fwd_bwd_ops(&z, targets, denom)?;
    Ok((ce, super::softcap::softcap_bwd(&z, &dz, cap)?))
}

/// Whether `cross_entropy_fwd_bwd` takes the kernel: a CUDA build, contiguous f32 or bf16
/// logits [n, V] on the GPU with 1 ≤ n < 2^31 (one thread block a row), u32 targets.
pub fn kernel_takes(logits: &Tensor, targets: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && logits.device().is_cuda()
        && matches!(logits.dtype(), DType::F32 | DType::BF16)
        && logits.is_contiguous()
        && targets.dtype() == DType::U32
        && logits
            .dims2()
            .is_ok_and(|(n, v)| (1..=i32::MAX as usize).contains(&n) && v > 0)
}

/// The same as tensor ops (the reference; the path on the CPU and for f16): f32 logits,
/// max-shifted exponentials, their sum, and the gradient from them.
pub(crate) fn cross_entropy_fwd_bwd_ops(
    logits: &Tensor,
    targets: &Tensor,
    denom: f64,
) -> Result<(Tensor, Tensor)> {
    let dtype = logits.dtype();
    let dev = logits.device().clone();
    let logits = logits.to_dtype(DType::F32)?; // [n, V]
    let n = logits.dim(0)?;
    let tgt = targets.unsqueeze(1)?; // [n, 1]
    let picked = logits.gather(&tgt, 1)?; // [n, 1]
    let max = logits.max_keepdim(1)?; // [n, 1]
    let e = logits.broadcast_sub(&max)?.exp()?; // [n, V]
    drop(logits);
    let sum = e.sum_keepdim(1)?; // [n, 1]
    let lse = (sum.log()? + &max)?;
    let ce = (lse - picked)?.squeeze(1)?; // [n]

    // dL/dlogits = (softmax − onehot) / denom
    let dl = e.broadcast_mul(&(sum * denom)?.recip()?)?;
    drop(e);
    let minus = Tensor::full(-1f32 / denom as f32, (n, 1), &dev)?;
    let dl = dl.scatter_add(&tgt, &minus, 1)?.to_dtype(dtype)?;
    Ok((ce, dl))
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, DType, Device, Result, Storage, Tensor};

    /// Threads a row: V = 32k–128k is 32–125 elements a thread.
    const THREADS: u32 = 256;

    /// The kernel; `cap` 0 for no soft-cap.
    pub(crate) fn fwd_bwd(
        logits: &Tensor,
        targets: &Tensor,
        denom: f64,
        cap: f64,
    ) -> Result<(Tensor, Tensor)> {
        match logits.dtype() {
            DType::F32 => launch::<f32>(logits, targets, denom, cap, "f32"),
            DType::BF16 => launch::<half::bf16>(logits, targets, denom, cap, "bf16"),
            d => {
                candle_core::bail!("cross_entropy: the kernel takes f32 or bf16 logits, got {d:?}")
            }
        }
    }

    fn launch<T: CudaDType + DeviceRepr>(
        logits: &Tensor,
        targets: &Tensor,
        denom: f64,
        cap: f64,
        suffix: &str,
    ) -> Result<(Tensor, Tensor)> {
        let (n, v) = logits.dims2()?;
        let Device::Cuda(dev) = logits.device() else {
            candle_core::bail!("cross_entropy: the kernel's logits must be on the GPU")
        };
        let targets = targets.contiguous()?;
        let (xs, xl) = logits.storage_and_layout();
        let (ts, tl) = targets.storage_and_layout();
        let (Storage::Cuda(xs), Storage::Cuda(ts)) = (&*xs, &*ts) else {
            candle_core::bail!("cross_entropy: logits on the GPU need targets on the GPU too")
        };
        let not_contiguous =
            || candle_core::Error::Msg("cross_entropy: input not contiguous".into());
        let (x0, x1) = xl.contiguous_offsets().ok_or_else(not_contiguous)?;
        let (t0, t1) = tl.contiguous_offsets().ok_or_else(not_contiguous)?;
        let x = xs.as_cuda_slice::<T>()?.slice(x0..x1);
        let t = ts.as_cuda_slice::<u32>()?.slice(t0..t1);
        // Four elements a thread when every row starts 4-element aligned (allocations are
        // 256-byte aligned, so that is the start offset and V).
        let name = if v % 4 == 0 && x0 % 4 == 0 {
            format!("cross_entropy4_{suffix}")
        } else {
            format!("cross_entropy_{suffix}")
        };
        let func = crate::ops::cuda::function(dev, &name)?;
        // SAFETY: the kernel writes every element of both (one ce a row, every gradient).
        let ce = unsafe { dev.alloc::<f32>(n)? };
        // SAFETY: as ce's: one block a row writes its V gradients.
        let dl = unsafe { dev.alloc::<T>(n * v)? };
        // The tensor ops' f32 factors: Σ·denom and −1/denom, each rounded from f64 as they are.
        let (v64, denom32, minus) = (v as i64, denom as f32, -1f32 / denom as f32);
        let cap = cap as f32;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&x)
            .arg(&t)
            .arg(&ce)
            .arg(&dl)
            .arg(&v64)
            .arg(&denom32)
            .arg(&minus)
            .arg(&cap);
        // SAFETY: x holds n·V elements and t n (shapes checked by the caller), ce and dl were
        // allocated for n and n·V; targets < V is the caller's contract (module docs).
        unsafe { b.launch(cfg) }.w()?;
        let wrap = |s: CudaStorage, shape: &[usize]| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        };
        let ce = wrap(CudaStorage::wrap_cuda_slice(ce, dev.clone()), &[n]);
        let dl = wrap(CudaStorage::wrap_cuda_slice(dl, dev.clone()), &[n, v]);
        Ok((ce, dl))
    }
}
