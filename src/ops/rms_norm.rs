//! RMSNorm with a frozen gain: y = x · rsqrt(mean(x²) + eps) · w, over the last dimension.
//!
//! Forward in f32 whatever the activation dtype (as transformers' LlamaRMSNorm does: it
//! upcasts, normalises, casts back, then multiplies by the weight in the weight's dtype).
//! Gemma's norms (`NormSpec::offset` = 1) multiply the unrounded f32 x̂ by 1 + w, the sum in
//! f32 (Gemma2RMSNorm: `x̂ * (1.0 + w.float())`, then one cast), with w as stored.

use super::{cpu_as_f32, cpu_from_f32, round_to};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

/// An RMSNorm's settings besides its gain: eps, and the offset added to the gain (0, or 1
/// for Gemma's 1 + w, which also leaves x̂ unrounded before the product). An f64 is an eps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormSpec {
    pub(crate) eps: f64,
    pub(crate) offset: f32,
}

impl From<f64> for NormSpec {
    fn from(eps: f64) -> Self {
        NormSpec { eps, offset: 0.0 }
    }
}

struct RmsNorm {
    /// [d]
    w: Tensor,
    eps: f32,
    offset: f32,
}

/// x: [..., d], w: [d] → [..., d]. Gradients flow to `x` only.
/// h = x + a (rounded to their dtype) and rms_norm(h, w): a residual add and the norm after it,
/// one pass on CUDA in bf16 (the two ops' values); elsewhere the two ops. No graph.
pub fn add_rms_norm(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    spec: impl Into<NormSpec>,
) -> Result<(Tensor, Tensor)> {
    let spec = spec.into();
    #[cfg(feature = "cuda")]
    if let Some(r) = cuda::add_rms_norm(x, a, w, spec)? {
        return Ok(r);
    }
    let h = super::add(x, a)?;
    let y = rms_norm(&h, w, spec)?;
    Ok((h, y))
}

/// x / rms(x) · w over x's last dim, as transformers computes it: `spec` gives ε and the
/// gain's offset (Gemma's 1 + w); w [d] has x's dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, spec: impl Into<NormSpec>) -> Result<Tensor> {
    let spec = spec.into();
    let x = x.contiguous()?;
    let op = RmsNorm {
        w: w.clone(),
        eps: spec.eps as f32,
        offset: spec.offset,
    };
    x.apply_op1_arc(std::sync::Arc::new(Box::new(op)))
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_as_f32(s, l)?;
        let w = self.w.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let d = w.len();
        if d == 0 || x.len() % d != 0 {
            candle_core::bail!("rms_norm: last dim does not match weight of {d}");
        }
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (ms + self.eps).sqrt();
            for ((yv, xv), wv) in yr.iter_mut().zip(xr).zip(&w) {
                // transformers rounds the normalised value to the input dtype before the gain
                // (not Gemma: its 1 + w multiplies the f32 value).
                let n = match self.offset {
                    0.0 => round_to(xv * r, s),
                    _ => xv * r,
                };
                *yv = n * (wv + self.offset);
            }
        }
        Ok((cpu_from_f32(y, s)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let candle_core::Storage::Cuda(w) = &*ws else {
            candle_core::bail!("rms_norm: weight is not on the GPU")
        };
        let spec = NormSpec {
            eps: self.eps as f64,
            offset: self.offset,
        };
        Ok((cuda::rms_norm(s, l, w, wl, spec)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let spec = NormSpec {
            eps: self.eps as f64,
            offset: self.offset,
        };
        Ok(Some(rms_norm_bwd(arg, &self.w, spec, grad_res)?))
    }
}

/// dL/dx of `rms_norm(x, w, spec)` given g = dL/dy; x, g: [..., d] → [..., d] in x's dtype.
pub fn rms_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    spec: impl Into<NormSpec>,
    g: &Tensor,
) -> Result<Tensor> {
    bwd(x, w, spec.into(), g, None)
}

/// `rms_norm_bwd(x, w, eps, g) + res`, res another term of dL/dx (x's shape; the residual
/// branch around the norm): on the fused bf16 path in the same pass, summed in f32 and rounded
/// once; elsewhere the composite and an add.
pub fn rms_norm_bwd_add(
    x: &Tensor,
    w: &Tensor,
    spec: impl Into<NormSpec>,
    g: &Tensor,
    res: &Tensor,
) -> Result<Tensor> {
    bwd(x, w, spec.into(), g, Some(res))
}

fn bwd(x: &Tensor, w: &Tensor, spec: NormSpec, g: &Tensor, res: Option<&Tensor>) -> Result<Tensor> {
    // bf16 (the training dtype on GPUs) takes one fused pass per row. f32 keeps the
    // composite below: it is the path the f32 golden tests hold to rtol 1e-4, and a
    // different f32 summation order moves Adam-amplified entries by ~1e-4 there.
    if x.dtype() == DType::BF16 {
        // dL/dy as the first columns of padded rows (ops::fold), read in place
        #[cfg(feature = "cuda")]
        if !g.is_contiguous() {
            if let Some(dx) = cuda::rms_norm_bwd_rows(x, w, spec, g, res)? {
                return Ok(dx);
            }
        }
        let op = RmsNormBwd {
            w: w.clone(),
            eps: spec.eps as f32,
            offset: spec.offset,
            res: res
                .map(|r| r.to_dtype(x.dtype())?.contiguous())
                .transpose()?,
        };
        return x
            .contiguous()?
            .apply_op2_no_bwd(&g.to_dtype(x.dtype())?.contiguous()?, &op);
    }
    let dx = composite(x, w, spec, g)?;
    match res {
        Some(r) => super::add(&dx, &r.to_dtype(dx.dtype())?),
        None => Ok(dx),
    }
}

/// The f32 composite of `rms_norm_bwd`.
fn composite(x: &Tensor, w: &Tensor, spec: NormSpec, g: &Tensor) -> Result<Tensor> {
    // With r = rsqrt(mean(x²)+eps), n = x·r, y = n·w (w + offset, the gain as applied):
    //   dx = r · (g·w − n · mean(g·w·n))
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let g = g.to_dtype(DType::F32)?;
    let w = (w.to_dtype(DType::F32)? + spec.offset as f64)?;
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + spec.eps)?
        .sqrt()?
        .recip()?;
    let n = x.broadcast_mul(&r)?;
    let gw = g.broadcast_mul(&w)?;
    let dot = (&gw * &n)?.mean_keepdim(D::Minus1)?;
    let dx = (gw - n.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
    dx.to_dtype(dtype)
}

/// (x, g) → dL/dx in one pass per row: with r = rsqrt(mean(x²)+eps),
///   dx = r · (g·w − x·r · mean(g·w·x·r))
struct RmsNormBwd {
    w: Tensor,
    eps: f32,
    /// Added to w (Gemma's 1 + w).
    offset: f32,
    /// Added to dx (contiguous, x's dtype and shape).
    res: Option<Tensor>,
}

impl candle_core::CustomOp2 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (cpu_as_f32(xs, xl)?, cpu_as_f32(gs, gl)?);
        let w: Vec<f32> = (self.w.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            .into_iter()
            .map(|w| w + self.offset)
            .collect();
        let d = w.len();
        let mut dx = vec![0f32; x.len()];
        for ((xr, gr), dr) in x
            .chunks_exact(d)
            .zip(g.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
        {
            let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() / d as f32 + self.eps).sqrt();
            let gwx: f32 = xr.iter().zip(gr).zip(&w).map(|((x, g), w)| g * w * x).sum();
            let dot = gwx * r / d as f32;
            for (((o, x), g), w) in dr.iter_mut().zip(xr).zip(gr).zip(&w) {
                *o = r * (g * w - x * r * dot);
            }
        }
        if let Some(res) = &self.res {
            let res = res.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            if res.len() != dx.len() {
                candle_core::bail!(
                    "rms_norm_bwd: residual of {} values for {}",
                    res.len(),
                    dx.len()
                );
            }
            for (o, r) in dx.iter_mut().zip(res) {
                *o += r;
            }
        }
        Ok((cpu_from_f32(dx, xs)?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let candle_core::Storage::Cuda(w) = &*ws else {
            candle_core::bail!("rms_norm: weight is not on the GPU")
        };
        let res = self.res.as_ref().map(|r| r.storage_and_layout());
        let res = match &res {
            Some((s, l)) => match &**s {
                candle_core::Storage::Cuda(c) => Some((c, *l)),
                _ => candle_core::bail!("rms_norm_bwd: residual is not on the GPU"),
            },
            None => None,
        };
        let spec = NormSpec {
            eps: self.eps as f64,
            offset: self.offset,
        };
        Ok((
            cuda::rms_norm_bwd(xs, xl, w, wl, gs, gl, res, spec)?,
            xl.shape().clone(),
        ))
    }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    //! The launchers of rms_norm.cu.
    use super::NormSpec;
    use crate::ops::cuda::{
        addr, addr_rows, contiguous, function, kernel, padded_rows, threads_for, uninit, v8_addrs,
        v8_rows, with_dtype, with_view,
    };
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    pub(crate) fn rms_norm(
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        spec: NormSpec,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let d = *xl.dims().last().unwrap_or(&1);
        let n = xl.shape().elem_count();
        let rows = n / d.max(1);
        if w.dtype() != x.dtype() {
            candle_core::bail!("rms_norm: weight {:?} vs input {:?}", w.dtype(), x.dtype());
        }
        let v8 = v8_rows(x, &[xl, wl], d);
        let (func, stream) = kernel(x, if v8 { "rms_norm_v8" } else { "rms_norm" })?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads_for((if v8 { d / 8 } else { d }).min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (w1, w2) = contiguous(wl)?;
        Ok(with_dtype!(x, xl, n, |xs, out| {
            let mut b = stream.launch_builder(&func);
            let (di, e, off) = (d as i32, spec.eps as f32, spec.offset);
            with_view!(w, w1..w2, |ws| {
                b.arg(&xs).arg(&ws).arg(&out).arg(&di).arg(&e).arg(&off);
                // SAFETY: one block a row of d: x contiguous, n = rows · d elements, out n
                // fresh ones all written; w of x's dtype (checked) holds d values, the norm's
                // weight of x's last dim (the caller's contract: the CPU path checks it, this
                // one does not); v8 only when d % 8 = 0 and every start is on 16 bytes.
                unsafe { b.launch(cfg) }.w()?;
            })
        }))
    }

    /// dL/dx of rms_norm, plus `res` (another term of dL/dx, of x's shape) when given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_bwd(
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        res: Option<(&CudaStorage, &Layout)>,
        spec: NormSpec,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let d = *xl.dims().last().unwrap_or(&1);
        let n = xl.shape().elem_count();
        let res_ok =
            res.is_none_or(|(r, rl)| r.dtype() == x.dtype() && rl.shape().elem_count() == n);
        if w.dtype() != x.dtype() || g.dtype() != x.dtype() || !res_ok {
            candle_core::bail!(
                "rms_norm_bwd: dtypes x {:?} w {:?} g {:?}, or a residual unlike x",
                x.dtype(),
                w.dtype(),
                g.dtype()
            );
        }
        // Without a residual g stands in for it (never read: has_res = 0).
        let (r, rl) = res.unwrap_or((g, gl));
        let v8 = v8_rows(x, &[xl, wl, gl, rl], d);
        let (func, stream) = kernel(
            x,
            if v8 {
                "rms_norm_bwd_v8"
            } else {
                "rms_norm_bwd"
            },
        )?;
        let cfg = LaunchConfig {
            grid_dim: ((n / d.max(1)) as u32, 1, 1),
            block_dim: (threads_for((if v8 { d / 8 } else { d }).min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (w1, w2) = contiguous(wl)?;
        let (g1, g2) = contiguous(gl)?;
        let (r1, r2) = contiguous(rl)?;
        let (di, e, hr, off) = (d as i32, spec.eps as f32, res.is_some() as i32, spec.offset);
        Ok(with_dtype!(x, xl, n, |xs, out| {
            let mut b = stream.launch_builder(&func);
            with_view!(w, w1..w2, |ws| {
                with_view!(g, g1..g2, |gv| {
                    with_view!(r, r1..r2, |rv| {
                        b.arg(&xs)
                            .arg(&ws)
                            .arg(&gv)
                            .arg(&rv)
                            .arg(&out)
                            .arg(&di)
                            .arg(&e)
                            .arg(&hr)
                            .arg(&off);
                        // SAFETY: as rms_norm's launch; g (and res, when given: x's dtype and
                        // n, checked) are contiguous rows of d; g has x's shape (the output's
                        // gradient: by construction, not checked here).
                        unsafe { b.launch(cfg) }.w()?;
                    })
                })
            })
        }))
    }

    /// `ops::rms_norm::add_rms_norm` on the GPU: (h, y) for bf16 x and a of one shape and w of
    /// their last dim d, all contiguous, on 16 bytes, d a multiple of 8; None otherwise.
    pub(crate) fn add_rms_norm(
        x: &candle_core::Tensor,
        a: &candle_core::Tensor,
        w: &candle_core::Tensor,
        spec: NormSpec,
    ) -> Result<Option<(candle_core::Tensor, candle_core::Tensor)>> {
        add_rms_norm_pad(x, a, w, spec, 0)
    }

    /// `add_rms_norm` with y's rows `pad` columns wider ([rows, d + pad], pad a multiple of 8; y as
    /// x's shape when pad = 0): the pad columns are left unset for the caller (`ops::fold`).
    pub(crate) fn add_rms_norm_pad(
        x: &candle_core::Tensor,
        a: &candle_core::Tensor,
        w: &candle_core::Tensor,
        spec: NormSpec,
        pad: usize,
    ) -> Result<Option<(candle_core::Tensor, candle_core::Tensor)>> {
        use candle_core::{op::BackpropOp, Device, Storage, Tensor};
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (n, d) = (x.elem_count(), w.elem_count());
        let bf16 = [x, a, w].iter().all(|t| t.dtype() == DType::BF16);
        if !bf16 || a.shape() != x.shape() || x.dims().last() != Some(&d) || d % 8 != 0 || n == 0 {
            return Ok(None);
        }
        if pad % 8 != 0 {
            return Ok(None);
        }
        let (rows, ldy) = (n / d, d + pad);
        let (Some(xp), Some(ap), Some(wp)) = (addr(x)?, addr(a)?, addr(w)?) else {
            return Ok(None);
        };
        if [xp, ap, wp].iter().any(|p| p % 16 != 0) {
            return Ok(None);
        }
        let func = function(dev, "add_rms_norm_v8_bf16")?;
        let stream = dev.cuda_stream();
        // SAFETY (both): every element is written by the kernel.
        let h = unsafe { stream.alloc::<half::bf16>(n) }.w()?;
        // SAFETY: as h's; y's pad columns are the caller's to write (see above).
        let y = unsafe { stream.alloc::<half::bf16>(rows * ldy) }.w()?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads_for((d / 8).min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, e, ldl, off) = (d as i32, spec.eps as f32, ldy as i64, spec.offset);
        let mut b = stream.launch_builder(&func);
        b.arg(&xp)
            .arg(&ap)
            .arg(&wp)
            .arg(&h)
            .arg(&y)
            .arg(&di)
            .arg(&e)
            .arg(&ldl)
            .arg(&off);
        // SAFETY: x, a, w are live contiguous bf16 buffers of the sizes checked, on this stream; h
        // and y are fresh.
        unsafe { b.launch(cfg) }.w()?;
        let wrap = |buf, shape: candle_core::Shape| {
            Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone())),
                shape,
                BackpropOp::none(),
                false,
            )
        };
        let y_shape = match pad {
            0 => x.shape().clone(),
            _ => (rows, ldy).into(),
        };
        Ok(Some((wrap(h, x.shape().clone()), wrap(y, y_shape))))
    }

    /// `rms_norm` of bf16 x [.., d] into the first d columns of a fresh [rows, d + pad] (pad a
    /// multiple of 8); the pad columns are left unset for the caller (`ops::fold`). None when the
    /// operands do not suit the 8-a-thread kernel.
    pub(crate) fn rms_norm_pad(
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        spec: NormSpec,
        pad: usize,
    ) -> Result<Option<candle_core::Tensor>> {
        use candle_core::Device;
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (n, d) = (x.elem_count(), w.elem_count());
        if x.dims().last() != Some(&d) || d % 8 != 0 || pad % 8 != 0 || n == 0 {
            return Ok(None);
        }
        let Some([xp, wp]) = v8_addrs([x, w])? else {
            return Ok(None);
        };
        let (rows, ldy) = (n / d, d + pad);
        // SAFETY: the kernel writes every row's first d columns; the pad is the caller's (above).
        let Some((y, yp)) = (unsafe { padded_rows(dev, rows, ldy)? }) else {
            return Ok(None);
        };
        let func = function(dev, "rms_norm_pad_v8_bf16")?;
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads_for((d / 8).min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, e, ldl, off) = (d as i32, spec.eps as f32, ldy as i64, spec.offset);
        let mut b = stream.launch_builder(&func);
        b.arg(&xp)
            .arg(&wp)
            .arg(&yp)
            .arg(&di)
            .arg(&e)
            .arg(&ldl)
            .arg(&off);
        // SAFETY: x and w are live contiguous bf16 buffers of the sizes checked, on this stream; y
        // is fresh, [rows, ldy].
        unsafe { b.launch(cfg) }.w()?;
        Ok(Some(y))
    }

    /// `ops::rms_norm_bwd(_add)` for bf16 x [.., d] (contiguous), w [d], g a row-strided [rows, d]
    /// (a padded dL/dy's first d columns, `ops::fold`) and `res` of x's shape or none: the v8
    /// kernel reading g's rows ldg apart. None where it cannot take them (then g is copied).
    pub(crate) fn rms_norm_bwd_rows(
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        spec: NormSpec,
        g: &candle_core::Tensor,
        res: Option<&candle_core::Tensor>,
    ) -> Result<Option<candle_core::Tensor>> {
        use candle_core::Device;
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (n, d) = (x.elem_count(), *x.dims().last().unwrap_or(&0));
        let (Ok((rows, gd)), Some((gp, ldg))) = (g.dims2(), addr_rows(g)?) else {
            return Ok(None);
        };
        let res_ok = res.is_none_or(|r| r.shape() == x.shape());
        if d == 0 || d % 8 != 0 || gd != d || rows * d != n || ldg % 8 != 0 || !res_ok {
            return Ok(None);
        }
        if g.dtype() != DType::BF16 || gp % 16 != 0 || w.elem_count() != d {
            return Ok(None);
        }
        let Some([xp, wp]) = v8_addrs([x, w])? else {
            return Ok(None);
        };
        // Without a residual g stands in for it (never read: has_res = 0).
        let rp = match res {
            Some(r) => match v8_addrs([r])? {
                Some([rp]) => rp,
                None => return Ok(None),
            },
            None => gp,
        };
        // SAFETY: the kernel writes every row's d values.
        let Some(dx) = (unsafe { uninit(dev, DType::BF16, x.shape().clone())? }) else {
            return Ok(None);
        };
        let Some(dp) = addr(&dx)? else {
            return Ok(None);
        };
        let func = function(dev, "rms_norm_bwd_ld_v8_bf16")?;
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads_for((d / 8).min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, hr, ldl) = (d as i32, res.is_some() as i32, ldg as i64);
        let (eps, off) = (spec.eps as f32, spec.offset);
        let mut b = stream.launch_builder(&func);
        b.arg(&xp)
            .arg(&wp)
            .arg(&gp)
            .arg(&rp)
            .arg(&dp)
            .arg(&di)
            .arg(&eps)
            .arg(&hr)
            .arg(&ldl)
            .arg(&off);
        // SAFETY: x, w and res are live contiguous bf16 buffers of the sizes checked, g rows of d
        // ldg apart; dx is fresh; all on this stream.
        unsafe { b.launch(cfg) }.w()?;
        Ok(Some(dx))
    }
}
