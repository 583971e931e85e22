//! a + b for same-shape activations, at memory speed on CUDA.
//!
//! candle's CUDA binary kernel makes an index computation per element; residuals, base + LoRA
//! and the sums of gradient branches are ~20 such adds a layer. Ours (add.cu) reads 16 bytes
//! per thread and keeps candle's rounding (f32 sum, rounded once). On the CPU, or for any
//! other layout or dtype, it is candle's own add.

use candle_core::{CustomOp2, Layout, Result, Shape, Tensor};

struct Add;

/// a + b, no graph (the hand-written backward passes only).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let fast = a.device().is_cuda()
        && a.shape() == b.shape()
        && a.dtype() == b.dtype()
        && matches!(
            a.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F32
        )
        && a.is_contiguous()
        && b.is_contiguous();
    if !fast {
        return a + b;
    }
    a.apply_op2_no_bwd(b, &Add)
}

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("ops::add: the CPU takes candle's add")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::add(a, al, b, bl)?, al.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The launcher of add.cu.
    use crate::ops::cuda::{contiguous, kernel, with_dtype, with_view};
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    /// a + b over contiguous a, b of one dtype (f32 or bf16).
    pub(crate) fn add(
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::DevicePtr;
        let n = al.shape().elem_count();
        if b.dtype() != a.dtype() || bl.shape().elem_count() != n {
            candle_core::bail!(
                "add: {:?} {:?} vs {:?} {:?}",
                a.dtype(),
                al.dims(),
                b.dtype(),
                bl.dims()
            );
        }
        let (func, stream) = kernel(a, "add")?;
        let (b1, b2) = contiguous(bl)?;
        let per = if a.dtype() == DType::BF16 { 8 } else { 4 }; // elements per 16 bytes
        let nl = n as i64;
        Ok(with_dtype!(a, al, n, |av, out| {
            with_view!(b, b1..b2, |bv| {
                // 16-byte vectors when every pointer is 16-byte aligned and n divides.
                let aligned = {
                    let (pa, _g1) = av.device_ptr(&stream);
                    let (pb, _g2) = bv.device_ptr(&stream);
                    let (po, _g3) = out.device_ptr(&stream);
                    (pa | pb | po) % 16 == 0
                };
                let vec = aligned && n % per == 0;
                let threads = if vec { n / per } else { n };
                let cfg = crate::ops::cuda::elems(threads.max(1))?;
                let vi = vec as i32;
                let mut bld = stream.launch_builder(&func);
                bld.arg(&av).arg(&bv).arg(&out).arg(&nl).arg(&vi);
                // SAFETY: a and b are contiguous views of n elements of one dtype (checked
                // above), out n fresh ones, all written; the vector path only when all three
                // addresses are 16-byte aligned and n divides by the vector. One stream.
                unsafe { bld.launch(cfg) }.w()?;
            })
        }))
    }
}
