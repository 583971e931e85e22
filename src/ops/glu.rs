//! The MLP's gated activation a = act(g) ⊙ u, one of two, with its backward in one pass:
//! SwiGLU (Llama, Mistral, Qwen, Phi-3) or GeGLU (Gemma, `gelu_pytorch_tanh`). The model's
//! config picks the activation (model/family.rs); the layer calls through `Act`.
//!
//! Rounding follows transformers in 16-bit dtypes: `act_fn(gate)` is rounded to the activation
//! dtype before the product, and the product is rounded again.
//!
//! Backward, from one read of (g, u, da), the output [2, ...] dg then du:
//!   du = da ⊙ act(g),   dg = (da ⊙ u) ⊙ act'(g)
//! silu, with σ = sigmoid(g):  act'(g) = σ (1 + g (1 − σ))
//! gelu_tanh, with t = tanh(k0 (g + k1 g³)), k0 = √(2/π), k1 = 0.044715 (PyTorch's
//! approximation):  gelu(g) = ½ g (1 + t),  gelu'(g) = ½ (1 + t) + ½ g (1 − t²) k0 (1 + 3 k1 g²)
//!
//! The CUDA kernels are glu.cu's, written once over the activation, named per activation.

use super::{cpu_as_f32, cpu_from_f32, round_to};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

const K0: f32 = 0.797_884_6; // √(2/π)
const K1: f32 = 0.044_715;

/// The gate's activation: a = act(g) ⊙ u.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// silu(g) ⊙ u.
    Silu,
    /// gelu_pytorch_tanh(g) ⊙ u.
    GeluTanh,
}

/// gelu_pytorch_tanh(g).
pub(crate) fn gelu_tanh(g: f32) -> f32 {
    0.5 * g * (1.0 + (K0 * (g + K1 * g * g * g)).tanh())
}

/// Its derivative.
pub(crate) fn gelu_tanh_grad(g: f32) -> f32 {
    let t = (K0 * (g + K1 * g * g * g)).tanh();
    0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * K0 * (1.0 + 3.0 * K1 * g * g)
}

/// g, u: [..., I] (same shape and dtype) → silu(g) ⊙ u. Differentiable in g and u.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    Act::Silu.glu(g, u)
}

/// (g, u, da) → (dg, du) of SwiGLU.
pub fn swiglu_bwd(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    Act::Silu.glu_bwd(g, u, da)
}

/// (g, u, da) → (dg, du, a) of SwiGLU, da consumed (`Act::glu_bwd_keep`).
pub fn swiglu_bwd_keep(g: &Tensor, u: &Tensor, da: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    Act::Silu.glu_bwd_keep(g, u, da)
}

impl Act {
    /// The kernels' name: `{name}`, `{name}_bwd`, `{name}_bwd_keep_v8_bf16`, `{name}_pad_v8_bf16`
    /// (glu.cu) and `{name}_lora_*` (fold_bwd.cu).
    pub(crate) fn kernel(self) -> &'static str {
        match self {
            Act::Silu => "swiglu",
            Act::GeluTanh => "geglu",
        }
    }

    /// act(g) as the forward computes it (f32).
    fn value(self, g: f32) -> f32 {
        match self {
            Act::Silu => g / (1.0 + (-g).exp()),
            Act::GeluTanh => gelu_tanh(g),
        }
    }

    /// (dg, du) of one element; `round` rounds to the activation dtype.
    fn bwd_one(self, g: f32, u: f32, da: f32, round: impl Fn(f32) -> f32) -> (f32, f32) {
        match self {
            Act::Silu => {
                let s = 1.0 / (1.0 + (-g).exp());
                (round(da * u) * s * (1.0 + g * (1.0 - s)), da * round(g * s))
            }
            Act::GeluTanh => (round(da * u) * gelu_tanh_grad(g), da * round(gelu_tanh(g))),
        }
    }

    /// g, u: [..., I] (same shape and dtype) → act(g) ⊙ u. Differentiable in g and u.
    pub fn glu(self, g: &Tensor, u: &Tensor) -> Result<Tensor> {
        if g.shape() != u.shape() {
            candle_core::bail!(
                "{}: gate {:?} vs up {:?}",
                self.kernel(),
                g.dims(),
                u.dims()
            );
        }
        g.contiguous()?.apply_op2(&u.contiguous()?, Glu(self))
    }

    /// (g, u, da) → (dg, du), each shaped like g.
    pub fn glu_bwd(self, g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
        let both = g.contiguous()?.apply_op3_no_bwd(
            &u.contiguous()?,
            &da.to_dtype(g.dtype())?.contiguous()?,
            &GluBwd(self),
        )?; // [2, ...]
        Ok((both.get(0)?, both.get(1)?))
    }

    /// `glu_bwd` and the forward's a = act(g) ⊙ u together: (g, u, da) → (dg, du, a). `da` is
    /// consumed: on CUDA (bf16) a is written over it in the same pass, so that a backward that
    /// needs a only after da (down_proj's adapter gradient) pays neither a pass nor a buffer for
    /// it; da must be a fresh result that nothing else holds. Elsewhere the two ops.
    pub fn glu_bwd_keep(
        self,
        g: &Tensor,
        u: &Tensor,
        da: Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        {
            let kernel = format!("{}_bwd_keep_v8_bf16", self.kernel());
            if let Some(r) = cuda::bwd_keep(&kernel, g, u, &da)? {
                return Ok(r);
            }
        }
        let (dg, du) = self.glu_bwd(g, u, &da)?;
        drop(da);
        Ok((dg, du, self.glu(g, u)?))
    }
}

struct Glu(Act);
struct GluBwd(Act);

impl CustomOp2 for Glu {
    fn name(&self) -> &'static str {
        self.0.kernel()
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (cpu_as_f32(gs, gl)?, cpu_as_f32(us, ul)?);
        let a = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| round_to(self.0.value(g), gs) * u)
            .collect();
        Ok((cpu_from_f32(a, gs)?, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::elementwise(self.0.kernel(), gs, gl, &[(us, ul)], 1)?;
        Ok((out, gl.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        da: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = self.0.glu_bwd(g, u, da)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for GluBwd {
    fn name(&self) -> &'static str {
        match self.0 {
            Act::Silu => "swiglu-bwd",
            Act::GeluTanh => "geglu-bwd",
        }
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
        das: &CpuStorage,
        dal: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u, da) = (
            cpu_as_f32(gs, gl)?,
            cpu_as_f32(us, ul)?,
            cpu_as_f32(das, dal)?,
        );
        let n = g.len();
        let mut out = vec![0f32; 2 * n];
        let (dg, du) = out.split_at_mut(n);
        for k in 0..n {
            (dg[k], du[k]) = self.0.bwd_one(g[k], u[k], da[k], |x| round_to(x, gs));
        }
        let mut dims = vec![2];
        dims.extend_from_slice(gl.dims());
        Ok((cpu_from_f32(out, gs)?, Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
        das: &candle_core::CudaStorage,
        dal: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let mut dims = vec![2];
        dims.extend_from_slice(gl.dims());
        let name = format!("{}_bwd", self.0.kernel());
        let out = cuda::elementwise(&name, gs, gl, &[(us, ul), (das, dal)], 2)?;
        Ok((out, Shape::from(dims)))
    }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    //! The launchers of glu.cu.
    use crate::ops::cuda::{
        addr, contiguous, function, kernel, padded_rows, v8_addrs, with_dtype, with_view,
    };
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    /// Runs `name_<dtype>(x, others..., out, n)` over n = |x| elements, one thread each, with a
    /// fresh output of `outs`·n elements. Every input has x's dtype and is contiguous.
    pub(super) fn elementwise(
        name: &str,
        x: &CudaStorage,
        xl: &Layout,
        others: &[(&CudaStorage, &Layout)],
        outs: usize,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let n = xl.shape().elem_count();
        for (o, ol) in others {
            if o.dtype() != x.dtype() || ol.shape().elem_count() != n {
                candle_core::bail!(
                    "{name}: inputs differ: {:?} {:?} vs {:?} {:?}",
                    x.dtype(),
                    xl.dims(),
                    o.dtype(),
                    ol.dims()
                );
            }
        }
        // bf16 with every start on 16 bytes and n a multiple of 8: the 8-a-thread kernel.
        let v8 = x.dtype() == DType::BF16
            && n % 8 == 0
            && std::iter::once(xl)
                .chain(others.iter().map(|(_, l)| *l))
                .all(|l| l.start_offset() % 8 == 0);
        let (func, stream) = kernel(
            x,
            &if v8 {
                format!("{name}_v8")
            } else {
                name.into()
            },
        )?;
        let cfg = crate::ops::cuda::elems((if v8 { n / 8 } else { n }).max(1))?;
        let nl = n as i64;
        let ranges = others
            .iter()
            .map(|(_, l)| contiguous(l))
            .collect::<Result<Vec<_>>>()?;
        Ok(with_dtype!(x, xl, outs * n, |xs, out| {
            let mut b = stream.launch_builder(&func);
            b.arg(&xs);
            match (others, ranges.as_slice()) {
                ([(o1, _)], [r1]) => with_view!(o1, r1.0..r1.1, |v1| {
                    b.arg(&v1).arg(&out).arg(&nl);
                    // SAFETY: x and the other input are contiguous views of n elements of x's
                    // dtype (checked above); out holds outs·n, every one written (one thread an
                    // element, or 8 on the v8 path, taken only with n % 8 = 0 and every start
                    // on 16 bytes). One stream: x's device's.
                    unsafe { b.launch(cfg) }.w()?;
                }),
                ([(o1, _), (o2, _)], [r1, r2]) => with_view!(o1, r1.0..r1.1, |v1| {
                    with_view!(o2, r2.0..r2.1, |v2| {
                        b.arg(&v1).arg(&v2).arg(&out).arg(&nl);
                        // SAFETY: as the one-input launch above, with both inputs checked.
                        unsafe { b.launch(cfg) }.w()?;
                    })
                }),
                _ => candle_core::bail!("{name}: one or two extra inputs expected"),
            }
        }))
    }

    /// The gated activation of bf16 g, u [.., d] (`kernel`: glu.cu's `swiglu_pad_v8_bf16` or
    /// `geglu_pad_v8_bf16`, one signature) into the first d columns of a fresh [rows, d + pad] (d
    /// and pad multiples of 8); the pad columns are left unset for the caller (`ops::fold`).
    pub(crate) fn glu_pad(
        kernel: &str,
        g: &candle_core::Tensor,
        u: &candle_core::Tensor,
        pad: usize,
    ) -> Result<Option<candle_core::Tensor>> {
        use candle_core::Device;
        let Device::Cuda(dev) = g.device() else {
            return Ok(None);
        };
        let n = g.elem_count();
        let d = *g.dims().last().unwrap_or(&0);
        if u.shape() != g.shape() || d % 8 != 0 || pad % 8 != 0 || n == 0 {
            return Ok(None);
        }
        let Some([gp, up]) = v8_addrs([g, u])? else {
            return Ok(None);
        };
        let (rows, lda) = (n / d, d + pad);
        // SAFETY: the kernel writes every row's first d columns; the pad is the caller's (above).
        let Some((a, ap)) = (unsafe { padded_rows(dev, rows, lda)? }) else {
            return Ok(None);
        };
        let func = function(dev, kernel)?;
        let stream = dev.cuda_stream();
        let cfg = crate::ops::cuda::elems(n / 8)?;
        let (nl, dl, ldl) = (n as i64, d as i64, lda as i64);
        let mut b = stream.launch_builder(&func);
        b.arg(&gp).arg(&up).arg(&ap).arg(&nl).arg(&dl).arg(&ldl);
        // SAFETY: g and u are live contiguous bf16 buffers of n elements on this stream; a is
        // fresh, [rows, lda].
        unsafe { b.launch(cfg) }.w()?;
        Ok(Some(a))
    }

    /// A gated backward that keeps a on the GPU (`kernel`: glu.cu's `*_bwd_keep_v8_bf16`):
    /// (dg, du, a) with a written over `da`'s buffer, for bf16 inputs of one shape, contiguous,
    /// on 16 bytes, of a multiple of 8 elements; None otherwise. `da` must be a fresh result
    /// that nothing else reads (its values are replaced).
    pub(crate) fn bwd_keep(
        kernel: &str,
        g: &candle_core::Tensor,
        u: &candle_core::Tensor,
        da: &candle_core::Tensor,
    ) -> Result<
        Option<(
            candle_core::Tensor,
            candle_core::Tensor,
            candle_core::Tensor,
        )>,
    > {
        use candle_core::{op::BackpropOp, Device, Storage, Tensor};
        let Device::Cuda(dev) = g.device() else {
            return Ok(None);
        };
        let n = g.elem_count();
        let same = [u, da]
            .iter()
            .all(|t| t.dtype() == DType::BF16 && t.shape() == g.shape());
        if g.dtype() != DType::BF16 || !same || n % 8 != 0 || n == 0 {
            return Ok(None);
        }
        let (Some(gp), Some(up), Some(dp)) = (addr(g)?, addr(u)?, addr(da)?) else {
            return Ok(None);
        };
        if [gp, up, dp].iter().any(|p| p % 16 != 0) {
            return Ok(None);
        }
        let func = function(dev, kernel)?;
        let stream = dev.cuda_stream();
        // SAFETY: every element is written by the kernel (dg, then du).
        let out = unsafe { stream.alloc::<half::bf16>(2 * n) }.w()?;
        let cfg = crate::ops::cuda::elems(n / 8)?;
        let nl = n as i64;
        let mut b = stream.launch_builder(&func);
        b.arg(&gp).arg(&up).arg(&dp).arg(&out).arg(&nl);
        // SAFETY: g, u and da are live contiguous bf16 buffers of n elements on this stream, out is
        // fresh; da is the caller's to overwrite (see above).
        unsafe { b.launch(cfg) }.w()?;
        let mut dims = vec![2];
        dims.extend_from_slice(g.dims());
        let both = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())),
            dims,
            BackpropOp::none(),
            false,
        );
        Ok(Some((both.get(0)?, both.get(1)?, da.clone())))
    }
}
