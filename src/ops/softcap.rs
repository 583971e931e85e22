//! Soft-capping (Gemma 2): y = cap · tanh(x / cap), which bounds |y| below cap, and its
//! backward from the output alone: dx = dy · (1 − (y / cap)²). The final logits take it
//! (`Model::head`); the attention scores take theirs inside the blockwise attention
//! (ops::attention), whose kernels cap each score block as they read it.

use super::{cpu_as_f32, cpu_from_f32};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

struct SoftCap(f32);
struct SoftCapBwd(f32);

/// x → cap · tanh(x / cap) in x's dtype (computed in f32), differentiable.
pub(crate) fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op1_arc(std::sync::Arc::new(Box::new(SoftCap(cap as f32))))
}

/// dL/dx of `softcap` from its output y and dy = dL/dy, in y's dtype.
pub(crate) fn softcap_bwd(y: &Tensor, dy: &Tensor, cap: f64) -> Result<Tensor> {
    y.contiguous()?.apply_op2_no_bwd(
        &dy.to_dtype(y.dtype())?.contiguous()?,
        &SoftCapBwd(cap as f32),
    )
}

impl CustomOp1 for SoftCap {
    fn name(&self) -> &'static str {
        "softcap"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = self.0;
        let y = cpu_as_f32(s, l)?
            .into_iter()
            .map(|x| c * (x / c).tanh())
            .collect();
        Ok((cpu_from_f32(y, s)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::launch("softcap", s, l, None, self.0)?,
            l.shape().clone(),
        ))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(softcap_bwd(res, grad_res, self.0 as f64)?))
    }
}

impl CustomOp2 for SoftCapBwd {
    fn name(&self) -> &'static str {
        "softcap-bwd"
    }

    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, g) = (cpu_as_f32(ys, yl)?, cpu_as_f32(gs, gl)?);
        let c = self.0;
        let dx = y
            .iter()
            .zip(&g)
            .map(|(y, g)| {
                let t = y / c;
                g * (1.0 - t * t)
            })
            .collect();
        Ok((cpu_from_f32(dx, ys)?, yl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::launch("softcap_bwd", ys, yl, Some((gs, gl)), self.0)?;
        Ok((out, yl.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The launcher of softcap.cu.
    use crate::ops::cuda::{contiguous, kernel, with_dtype, with_view};
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    /// `name_<dtype>(x, [g,] out, n, cap)` over the n elements of x (and g, of x's dtype).
    pub(crate) fn launch(
        name: &str,
        x: &CudaStorage,
        xl: &Layout,
        g: Option<(&CudaStorage, &Layout)>,
        cap: f32,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let n = xl.shape().elem_count();
        if let Some((gs, gl)) = g {
            if gs.dtype() != x.dtype() || gl.shape().elem_count() != n {
                candle_core::bail!("{name}: y {:?} vs dy {:?}", x.dtype(), gs.dtype());
            }
        }
        let (func, stream) = kernel(x, name)?;
        let cfg = crate::ops::cuda::elems(n.max(1))?;
        let nl = n as i64;
        Ok(with_dtype!(x, xl, n, |xs, out| {
            let mut b = stream.launch_builder(&func);
            b.arg(&xs);
            match g {
                Some((gs, gl)) => {
                    let (g1, g2) = contiguous(gl)?;
                    with_view!(gs, g1..g2, |gv| {
                        b.arg(&gv).arg(&out).arg(&nl).arg(&cap);
                        // SAFETY: x and g are live contiguous buffers of n elements, out fresh.
                        unsafe { b.launch(cfg) }.w()?;
                    })
                }
                None => {
                    b.arg(&out).arg(&nl).arg(&cap);
                    // SAFETY: x is a live contiguous buffer of n elements, out fresh.
                    unsafe { b.launch(cfg) }.w()?;
                }
            }
        }))
    }
}
