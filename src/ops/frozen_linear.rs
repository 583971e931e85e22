//! y = x Wᵀ (+ b) with W and b frozen: backward returns dL/dx = g W and nothing else.
//!
//! candle's own matmul backward computes dW = xᵀ g for every operand, which for a frozen
//! base costs a full extra GEMM and a weight-sized buffer per layer. Here W is not an operand
//! of the graph at all, so no gradient for it can exist.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

struct FrozenLinear {
    /// [out, in], contiguous
    w: Tensor,
    /// [out]
    b: Option<Tensor>,
}

/// x: [..., in], w: [out, in], b: [out] → [..., out]. Gradients flow to `x` only.
pub fn frozen_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = FrozenLinear {
        w: w.contiguous()?,
        b: b.cloned(),
    };
    x.apply_op1_arc(std::sync::Arc::new(Box::new(op)))
}

impl FrozenLinear {
    /// The storage-level forward, shared by every backend: one GEMM [m, k] × [k, n] and an
    /// optional broadcast bias add.
    fn fwd<S: BackendStorage>(
        &self,
        x: &S,
        xl: &Layout,
        w: &S,
        wl: &Layout,
        b: Option<(&S, &Layout)>,
    ) -> Result<(S, Shape)> {
        let dims = xl.dims();
        let k = *dims.last().unwrap_or(&0);
        let (n, wk) = wl.shape().dims2()?;
        if wk != k {
            candle_core::bail!("frozen_linear: input has {k} features, weight expects {wk}");
        }
        let m = xl.shape().elem_count() / k.max(1);
        let (x_off, _) = xl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("frozen_linear: x not contiguous".into()))?;
        let (w_off, _) = wl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("frozen_linear: w not contiguous".into()))?;
        let lhs_l = Layout::contiguous_with_offset((m, k), x_off);
        let rhs_l = Layout::contiguous_with_offset((n, k), w_off).transpose(0, 1)?;
        let mut out = x.matmul(w, (1, m, n, k), &lhs_l, &rhs_l)?;
        if let Some((bs, bl)) = b {
            let out_l = Layout::contiguous((m, n));
            out = out.binary_impl::<candle_core::op::Add>(bs, &out_l, &bl.broadcast_as((m, n))?)?;
        }
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = n;
        }
        Ok((out, Shape::from(out_dims)))
    }
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cpu(w) = &*ws else {
            candle_core::bail!("frozen_linear: weight is not on the CPU")
        };
        match &self.b {
            None => self.fwd(x, xl, w, wl, None),
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                let Storage::Cpu(bs) = &*bs else {
                    candle_core::bail!("frozen_linear: bias is not on the CPU")
                };
                self.fwd(x, xl, w, wl, Some((bs, bl)))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cuda(w) = &*ws else {
            candle_core::bail!("frozen_linear: weight is not on the GPU")
        };
        match &self.b {
            None => self.fwd(x, xl, w, wl, None),
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                let Storage::Cuda(bs) = &*bs else {
                    candle_core::bail!("frozen_linear: bias is not on the GPU")
                };
                self.fwd(x, xl, w, wl, Some((bs, bl)))
            }
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // dL/dx [m, k] = g [m, n] · W [n, k]
        let n = self.w.dim(0)?;
        let g = grad_res.contiguous()?.reshape(((), n))?;
        Ok(Some(g.matmul(&self.w)?.reshape(arg.shape())?))
    }
}
