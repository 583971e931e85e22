//! SwiGLU, the Llama MLP's gate: a = silu(g) ⊙ u, with its backward in one pass.
//!
//! Rounding follows transformers in 16-bit dtypes: `act_fn(gate)` is rounded to the activation
//! dtype before the product, and the product is rounded again.
//!
//! Backward, with σ = sigmoid(g):
//!   du = da ⊙ silu(g),   dg = (da ⊙ u) ⊙ σ (1 + g (1 − σ))
//! both from one read of (g, u, da): the output is [2, ...], dg then du.

use super::{cpu_as_f32, cpu_from_f32, round_to};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

struct SwiGlu;
struct SwiGluBwd;

/// g, u: [..., I] (same shape and dtype) → silu(g) ⊙ u. Differentiable in g and u.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        candle_core::bail!("swiglu: gate {:?} vs up {:?}", g.dims(), u.dims());
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}

/// (g, u, da) → (dg, du), each shaped like g.
pub fn swiglu_bwd(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = g.contiguous()?.apply_op3_no_bwd(
        &u.contiguous()?,
        &da.to_dtype(g.dtype())?.contiguous()?,
        &SwiGluBwd,
    )?; // [2, ...]
    Ok((both.get(0)?, both.get(1)?))
}

/// `swiglu_bwd` and the forward's a = silu(g) ⊙ u together: (g, u, da) → (dg, du, a). `da` is
/// consumed: on CUDA (bf16) a is written over it in the same pass, so that a backward that
/// needs a only after da (down_proj's adapter gradient) pays neither a pass nor a buffer for
/// it; da must be a fresh result that nothing else holds. Elsewhere the two ops.
pub fn swiglu_bwd_keep(g: &Tensor, u: &Tensor, da: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(r) = cuda::bwd_keep("swiglu_bwd_keep_v8_bf16", g, u, &da)? {
        return Ok(r);
    }
    let (dg, du) = swiglu_bwd(g, u, &da)?;
    drop(da);
    Ok((dg, du, swiglu(g, u)?))
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
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
            .map(|(&g, &u)| round_to(silu(g), gs) * u)
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
        Ok((cuda::swiglu(gs, gl, us, ul)?, gl.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        da: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = swiglu_bwd(g, u, da)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
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
            let s = 1.0 / (1.0 + (-g[k]).exp());
            dg[k] = round_to(da[k] * u[k], gs) * s * (1.0 + g[k] * (1.0 - s));
            du[k] = da[k] * round_to(g[k] * s, gs);
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
        Ok((
            cuda::swiglu_bwd(gs, gl, us, ul, das, dal)?,
            Shape::from(dims),
        ))
    }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    //! The launchers of swiglu.cu.
    use crate::ops::cuda::{
        addr, contiguous, function, kernel, padded_rows, v8_addrs, with_dtype, with_view,
    };
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    /// a = silu(g) ⊙ u over contiguous g, u of one dtype.
    pub fn swiglu(
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<CudaStorage> {
        elementwise("swiglu", g, gl, &[(u, ul)], 1)
    }

    /// (g, u, da) → [dg; du] (2n elements).
    pub fn swiglu_bwd(
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
        da: &CudaStorage,
        dal: &Layout,
    ) -> Result<CudaStorage> {
        elementwise("swiglu_bwd", g, gl, &[(u, ul), (da, dal)], 2)
    }

    /// Runs `name_<dtype>(x, others..., out, n)` over n = |x| elements, one thread each, with a
    /// fresh output of `outs`·n elements. Every input has x's dtype and is contiguous.
    /// (ops::geglu's launches go through here too.)
    pub(crate) fn elementwise(
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
                    unsafe { b.launch(cfg) }.w()?;
                }),
                ([(o1, _), (o2, _)], [r1, r2]) => with_view!(o1, r1.0..r1.1, |v1| {
                    with_view!(o2, r2.0..r2.1, |v2| {
                        b.arg(&v1).arg(&v2).arg(&out).arg(&nl);
                        unsafe { b.launch(cfg) }.w()?;
                    })
                }),
                _ => candle_core::bail!("{name}: one or two extra inputs expected"),
            }
        }))
    }

    /// The gated activation of bf16 g, u [.., d] (`kernel`: geglu.cu's `swiglu_pad_v8_bf16` or
    /// `geglu_pad_v8_bf16`, one signature) into the first d columns of a fresh [rows, d + pad] (d
    /// and pad multiples of 8); the pad columns are left unset for the caller (`ops::fold`).
    pub fn glu_pad(
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

    /// A gated backward that keeps a on the GPU (`kernel`: swiglu.cu's or geglu.cu's
    /// `*_bwd_keep_v8_bf16`, one signature): (dg, du, a) with a written over `da`'s buffer, for
    /// bf16 inputs of one shape, contiguous, on 16 bytes, of a multiple of 8 elements; None
    /// otherwise. `da` must be a fresh result that nothing else reads (its values are replaced).
    pub fn bwd_keep(
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
