//! The LoRA linear as one graph node: y = x Wᵀ (+ b) + s · (m ⊙ x) Aᵀ Bᵀ.
//!
//! x: [..., in], W: [out, in] frozen, A: [r, in] and B: [out, r] f32 trainable, m an optional
//! dropout mask (same shape as x), s the scale. Autograd keeps x, A, B and y only (a chain of
//! candle ops would keep every intermediate: x Wᵀ, x Aᵀ, (x Aᵀ) Bᵀ, its scaled copy, the sum).
//! Backward (g = dL/dy, xd = m ⊙ x, xa = xd Aᵀ recomputed, r×in work only):
//!   dx = g W + s · ((g B) A) ⊙ m,   dA = s · (g B)ᵀ xd,   dB = s · gᵀ xa

use super::attach::attach3;
use super::frozen_linear::frozen_linear;
use candle_core::{DType, Result, Tensor};

pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    mask: Option<Tensor>,
) -> Result<Tensor> {
    let dt = x.dtype();
    let in_f = *x.dims().last().unwrap_or(&0);
    let out_f = w.dim(0)?;
    let x2 = x.detach().reshape(((), in_f))?; // [m, in]
    let xd = match &mask {
        Some(m) => x2.mul(&m.reshape(((), in_f))?.to_dtype(dt)?)?,
        None => x2.clone(),
    };
    let (ad, bd) = (a.detach().to_dtype(dt)?, b.detach().to_dtype(dt)?);
    let base = frozen_linear(&x2, w, bias)?; // [m, out]
                                             // The scale goes on the [m, r] intermediate, not on the [m, out] product.
    let y = (base + (xd.matmul(&ad.t()?)? * scale)?.matmul(&bd.t()?)?)?;
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = out_f;
    }
    let y = y.reshape(dims)?;
    let w = w.clone();
    let backward = move |x: &Tensor, a: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor| {
        let dt = x.dtype();
        let x2 = x.reshape(((), in_f))?;
        let xd = match &mask {
            Some(m) => x2.mul(&m.reshape(((), in_f))?.to_dtype(dt)?)?,
            None => x2,
        };
        let g = g.reshape(((), out_f))?; // [m, out]
        let (ad, bd) = (a.to_dtype(dt)?, b.to_dtype(dt)?);
        let gb = g.matmul(&bd)?; // [m, r]
        let gbs = (&gb * scale)?; // [m, r]: scaled while small
        let mut dlora = gbs.matmul(&ad)?; // [m, in]
        if let Some(m) = &mask {
            dlora = dlora.mul(&m.reshape(((), in_f))?.to_dtype(dt)?)?;
        }
        let dx = (g.matmul(&w)? + dlora)?.reshape(x.shape())?;
        let da = gbs.t()?.matmul(&xd)?.to_dtype(DType::F32)?; // [r, in]
        let xa = xd.matmul(&ad.t()?)?; // [m, r]
        let db = g.t()?.matmul(&(xa * scale)?)?.to_dtype(DType::F32)?; // [out, r]
        Ok((
            Some(dx),
            Some(da.to_dtype(a.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ))
    };
    attach3(x, a, b, y, Box::new(backward))
}
