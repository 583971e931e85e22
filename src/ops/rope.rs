//! Rotary position embedding (the "rotate half" layout of HF Llama) with per-token positions.
//!
//! For each pair (x1, x2) = (x[..i], x[..i + D/2]):
//!   y1 = x1·cos − x2·sin,  y2 = x2·cos + x1·sin
//! The backward is the inverse rotation: the same op with sin negated.

use super::{cpu_as_f32, cpu_from_f32};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

struct Rope {
    /// [B, T, D/2] f32
    cos: Tensor,
    /// [B, T, D/2] f32
    sin: Tensor,
}

/// x: [B, H, T, D]; cos, sin: [B, T, D/2] (f32, gathered at each token's position).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = Rope {
        cos: cos.clone(),
        sin: sin.clone(),
    };
    x.apply_op1_arc(std::sync::Arc::new(Box::new(op)))
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = l.shape().dims4()?;
        let (cb, ct, half) = self.cos.dims3()?;
        if cb != b || ct != t || half * 2 != d {
            candle_core::bail!(
                "rope: x {:?} does not match cos {:?}",
                l.dims(),
                self.cos.dims()
            );
        }
        let x = cpu_as_f32(s, l)?;
        let cos = self
            .cos
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let sin = self
            .sin
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut y = vec![0f32; x.len()];
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let row = ((bi * h + hi) * t + ti) * d;
                    let cs = (bi * t + ti) * half;
                    for i in 0..half {
                        let (x1, x2) = (x[row + i], x[row + i + half]);
                        let (c, sn) = (cos[cs + i], sin[cs + i]);
                        y[row + i] = x1 * c - x2 * sn;
                        y[row + i + half] = x2 * c + x1 * sn;
                    }
                }
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
        let (cs, cl) = self.cos.storage_and_layout();
        let (ss, sl) = self.sin.storage_and_layout();
        let (candle_core::Storage::Cuda(c), candle_core::Storage::Cuda(sn)) = (&*cs, &*ss) else {
            candle_core::bail!("rope: cos/sin are not on the GPU")
        };
        Ok((cuda::rope(s, l, c, cl, sn, sl)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Rope {
            cos: self.cos.clone(),
            sin: self.sin.neg()?,
        };
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}

/// Token-major rows [B·T, H·D] ↔ head-major [B, H, T, D], with or without the rotation, in one
/// pass: the attention layout change and RoPE fused (a strided copy then a rotation would read
/// and write the tensor twice).
struct Relayout {
    /// (cos, sin) [B, T, D/2] f32 to rotate by; None: a plain layout change.
    rot: Option<(Tensor, Tensor)>,
    /// +1 rotates by θ (RoPE), −1 by −θ (its backward).
    sign: f32,
    /// rows → heads (else heads → rows).
    to_heads: bool,
    b: usize,
    t: usize,
    h: usize,
}

/// x rows [B·T, H·D] → [B, H, T, D] rotated by RoPE: `rope` of the transposed heads.
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, h: usize) -> Result<Tensor> {
    let (b, t, _) = cos.dims3()?;
    relayout(x, Some((cos, sin)), 1.0, true, b, t, h)
}

/// g [B, H, T, D] → rows [B·T, H·D] rotated by −θ: the backward of `rope_heads`.
pub fn rope_rows_inv(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, _) = g.dims4()?;
    relayout(g, Some((cos, sin)), -1.0, false, b, t, h)
}

/// rows [B·T, H·D] → [B, H, T, D].
pub fn to_heads(x: &Tensor, b: usize, t: usize, h: usize) -> Result<Tensor> {
    relayout(x, None, 1.0, true, b, t, h)
}

/// [B, H, T, D] → rows [B·T, H·D].
pub fn to_rows(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, _) = x.dims4()?;
    relayout(x, None, 1.0, false, b, t, h)
}

fn relayout(
    x: &Tensor,
    rot: Option<(&Tensor, &Tensor)>,
    sign: f32,
    to_heads: bool,
    b: usize,
    t: usize,
    h: usize,
) -> Result<Tensor> {
    let n = x.elem_count();
    if b * t * h == 0 || n % (b * t * h) != 0 || (n / (b * t * h)) % 2 != 0 {
        candle_core::bail!(
            "relayout: {:?} is not B={b} × T={t} × H={h} × an even D",
            x.dims()
        );
    }
    let op = Relayout {
        rot: rot.map(|(c, s)| (c.clone(), s.clone())),
        sign,
        to_heads,
        b,
        t,
        h,
    };
    x.contiguous()?.apply_op1_no_bwd(&op)
}

impl Relayout {
    fn out_shape(&self, n: usize) -> Shape {
        let d = n / (self.b * self.t * self.h);
        if self.to_heads {
            (self.b, self.h, self.t, d).into()
        } else {
            (self.b * self.t, self.h * d).into()
        }
    }
}

impl CustomOp1 for Relayout {
    fn name(&self) -> &'static str {
        "relayout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_as_f32(s, l)?;
        let (b, t, h) = (self.b, self.t, self.h);
        let d = x.len() / (b * t * h);
        let half = d / 2;
        let rot = match &self.rot {
            Some((c, sn)) => Some((
                c.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                sn.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            )),
            None => None,
        };
        let mut y = vec![0f32; x.len()];
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let heads = ((bi * h + hi) * t + ti) * d;
                    let rows = ((bi * t + ti) * h + hi) * d;
                    let (src, dst) = if self.to_heads {
                        (rows, heads)
                    } else {
                        (heads, rows)
                    };
                    let cs = (bi * t + ti) * half;
                    for i in 0..half {
                        let (x1, x2) = (x[src + i], x[src + i + half]);
                        let (y1, y2) = match &rot {
                            Some((c, sn)) => {
                                let (c, sn) = (c[cs + i], self.sign * sn[cs + i]);
                                (x1 * c - x2 * sn, x2 * c + x1 * sn)
                            }
                            None => (x1, x2),
                        };
                        y[dst + i] = y1;
                        y[dst + i + half] = y2;
                    }
                }
            }
        }
        Ok((cpu_from_f32(y, s)?, self.out_shape(x.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = l.shape().elem_count();
        let out = match &self.rot {
            Some((c, sn)) => {
                let (cs, cl) = c.storage_and_layout();
                let (ss, sl) = sn.storage_and_layout();
                let (candle_core::Storage::Cuda(c), candle_core::Storage::Cuda(sn)) = (&*cs, &*ss)
                else {
                    candle_core::bail!("rope: cos/sin are not on the GPU")
                };
                cuda::relayout(
                    s,
                    l,
                    Some((c, cl, sn, sl)),
                    self.sign,
                    self.to_heads,
                    [self.b, self.t, self.h],
                )?
            }
            None => cuda::relayout(s, l, None, 1.0, self.to_heads, [self.b, self.t, self.h])?,
        };
        Ok((out, self.out_shape(n)))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The launchers of rope.cu.
    use crate::ops::cuda::{contiguous, kernel, with_dtype};
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    pub(crate) fn rope(
        x: &CudaStorage,
        xl: &Layout,
        cos: &CudaStorage,
        cl: &Layout,
        sin: &CudaStorage,
        sl: &Layout,
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let (_b, h, t, d) = xl.shape().dims4()?;
        let n = xl.shape().elem_count();
        let pairs = (n / 2) as i64;
        let (func, stream) = kernel(x, "rope")?;
        let cfg = crate::ops::cuda::elems(pairs as usize)?;
        let (c1, c2) = contiguous(cl)?;
        let (s1, s2) = contiguous(sl)?;
        let cs = cos.as_cuda_slice::<f32>()?.slice(c1..c2);
        let ss = sin.as_cuda_slice::<f32>()?.slice(s1..s2);
        let (hi, ti, half) = (h as i32, t as i32, (d / 2) as i32);
        Ok(with_dtype!(x, xl, n, |xs, out| {
            let mut b = stream.launch_builder(&func);
            b.arg(&xs)
                .arg(&cs)
                .arg(&ss)
                .arg(&out)
                .arg(&hi)
                .arg(&ti)
                .arg(&half)
                .arg(&pairs);
            // SAFETY: one thread a pair of the contiguous [B, H, T, D] x, out n fresh elements
            // all written; cos and sin are contiguous f32 views read at (b·T + t)·D/2 + i, which
            // needs them [B, T, D/2] (`rope`'s contract: the CPU path checks it, this one does
            // not). One stream: x's device's.
            unsafe { b.launch(cfg) }.w()?;
        }))
    }

    /// Rows [B·T, H·D] <-> [B, H, T, D] (`to_heads` picks the direction), rotated by sign·θ when
    /// `rot` = (cos, sin) [B, T, D/2] f32 is given. `bth` = [B, T, H].
    pub(crate) fn relayout(
        x: &CudaStorage,
        xl: &Layout,
        rot: Option<(&CudaStorage, &Layout, &CudaStorage, &Layout)>,
        sign: f32,
        to_heads: bool,
        bth: [usize; 3],
    ) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let [b, t, h] = bth;
        let n = xl.shape().elem_count();
        let pairs = (n / 2) as i64;
        let half = (n / (b * t * h) / 2) as i32;
        let (o1, _) = contiguous(xl)?;
        // 4 pairs a thread when every 4-element run is aligned: half % 4, the input's offset, and
        // the allocations (8 bytes for bf16, 16 for f32; candle allocates 256-aligned).
        let vec = half % 4 == 0 && o1 % 4 == 0;
        let (func, stream) = kernel(x, if vec { "relayout4" } else { "relayout" })?;
        let units = if vec { pairs / 4 } else { pairs };
        let cfg = crate::ops::cuda::elems(units as usize)?;
        let (hi, ti, th, sg) = (h as i32, t as i32, to_heads as i32, sign);
        let null: u64 = 0;
        Ok(with_dtype!(x, xl, n, |xs, out| {
            let mut bld = stream.launch_builder(&func);
            bld.arg(&xs);
            let views = match rot {
                Some((c, cl, s, sl)) => {
                    let (c1, c2) = contiguous(cl)?;
                    let (s1, s2) = contiguous(sl)?;
                    Some((
                        c.as_cuda_slice::<f32>()?.slice(c1..c2),
                        s.as_cuda_slice::<f32>()?.slice(s1..s2),
                    ))
                }
                None => None,
            };
            match &views {
                Some((cv, sv)) => bld.arg(cv).arg(sv),
                None => bld.arg(&null).arg(&null),
            };
            bld.arg(&out)
                .arg(&hi)
                .arg(&ti)
                .arg(&half)
                .arg(&units)
                .arg(&th)
                .arg(&sg);
            // SAFETY: `relayout` checked n = B·T·H·D with D even; x is contiguous, out n fresh
            // elements all written; the 4-pair path only when half % 4 = 0 and x's offset is on
            // 4 elements (allocations are 256-byte aligned); cos and sin, when given, are
            // contiguous f32 [B, T, D/2] (the caller's tables, not checked here). One stream.
            unsafe { bld.launch(cfg) }.w()?;
        }))
    }
}
