//! Rotary position embedding (the "rotate half" layout of HF Llama) with per-token positions.
//!
//! For each pair (x1, x2) = (x[..i], x[..i + D/2]):
//!   y1 = x1·cos − x2·sin,  y2 = x2·cos + x1·sin
//! The backward is the inverse rotation: the same op with sin negated.

use super::{cpu_as_f32, cpu_from_f32};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

struct Rope {
    cos: Tensor, // [B, T, D/2] f32
    sin: Tensor, // [B, T, D/2] f32
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
        Ok((super::cuda::rope(s, l, c, cl, sn, sl)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Rope {
            cos: self.cos.clone(),
            sin: self.sin.neg()?,
        };
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}
