//! The LoRA linear as one graph node: y = x Wᵀ (+ b) + s · (m ⊙ x) Aᵀ Bᵀ.
//!
//! x: [..., in], W: [out, in] frozen, A: [r, in] and B: [out, r] f32 trainable, m an optional
//! dropout mask (same shape as x), s the scale. Autograd keeps x, A, B and y only (a chain of
//! candle ops would keep every intermediate: x Wᵀ, x Aᵀ, (x Aᵀ) Bᵀ, its scaled copy, the sum).
//! Backward (g = dL/dy, xd = m ⊙ x, xas = s · xd Aᵀ kept from forward: [m, r]):
//!   dx = g W + s · ((g B) A) ⊙ m,   dA = s · (g B)ᵀ xd,   dB = gᵀ xas

use super::attach::attach3;
use super::frozen_linear::frozen_linear;
use candle_core::{Result, Tensor};

pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    mask: Option<Tensor>,
) -> Result<Tensor> {
    let in_f = *x.dims().last().unwrap_or(&0);
    let out_f = w.dim(0)?;
    let x2 = x.detach().reshape(((), in_f))?; // [m, in]
    let (y, xas) = lora_fwd(&x2, w, bias, &a.detach(), &b.detach(), scale, mask.as_ref())?;
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = out_f;
    }
    let y = y.reshape(dims)?;
    let w = w.clone();
    let backward = move |x: &Tensor, a: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor| {
        let x2 = x.reshape(((), in_f))?;
        let g = g.reshape(((), out_f))?;
        let (dx, da, db) = lora_bwd(&x2, &g, &w, a, b, scale, mask.as_ref(), &xas, None)?;
        Ok((
            Some(dx.reshape(x.shape())?),
            Some(da.to_dtype(a.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ))
    };
    attach3(x, a, b, y, Box::new(backward))
}

/// The forward without a graph. x: [m, in] → (y [m, out], xas = s · (m ⊙ x) Aᵀ [m, r]);
/// `xas` is what backward needs besides x (r columns: small enough to keep).
pub fn lora_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let xas = lora_xas(x, a, scale, mask)?; // [m, r]
                                            // Detached: the adapters are Vars, and a graph through them would keep every activation.
    let bd = b.detach().to_dtype(x.dtype())?;
    // The adapter's term alone (full bf16 precision however small), then the base GEMM adds
    // onto it in f32 (its epilogue): one rounding of the sum, at the base output's scale.
    let lora = xas.matmul(&bd.t()?)?; // [m, out]
    let y = match bias {
        None => super::linear_acc::linear_acc(x, w, lora)?, // the base GEMM adds onto it
        Some(_) => super::add(&frozen_linear(x, w, bias)?, &lora)?,
    };
    Ok((y, xas))
}

/// The adapter's half of `lora_fwd`'s state alone: xas = s · (m ⊙ x) Aᵀ [m, r] (what a
/// recomputed layer's backward needs of a linear whose output it does not).
pub fn lora_xas(x: &Tensor, a: &Tensor, scale: f64, mask: Option<&Tensor>) -> Result<Tensor> {
    let ad = a.detach().to_dtype(x.dtype())?;
    masked(x, mask)?.matmul(&ad.t()?)? * scale // scaled while small
}

/// The backward: x [m, in] (unmasked), g = dL/dy [m, out], `xas` from `lora_fwd`, and `acc`
/// another term of dL/dx to add in (consumed: the sum of several linears' dL/dx, as q, k and
/// v share their input) → (dx [m, in] in x's dtype, dA [r, in] f32, dB [out, r] f32).
#[allow(clippy::too_many_arguments)]
pub fn lora_bwd(
    x: &Tensor,
    g: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    xas: &Tensor,
    acc: Option<Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    use super::linear_acc::linear_bwd_acc;
    let dt = x.dtype();
    let g = g.contiguous()?;
    let (ad, bd) = (a.detach().to_dtype(dt)?, b.detach().to_dtype(dt)?);
    let gbs = (g.matmul(&bd)? * scale)?; // [m, r]
    let dlora = match (mask, acc) {
        (None, Some(acc)) => linear_bwd_acc(&gbs, &ad, acc)?, // acc + gbs A, one pass
        (mask, acc) => {
            let d = masked(&gbs.matmul(&ad)?, mask)?; // [m, in]
            match acc {
                Some(acc) => super::add(&acc, &d)?,
                None => d,
            }
        }
    };
    let dx = linear_bwd_acc(&g, w, dlora)?; // g W + dlora
                                            // f32 straight out of the GEMMs (on CUDA; elsewhere a product and a cast)
    let da = super::linear_acc::matmul_tn_f32(&gbs, &masked(x, mask)?)?; // [r, in]
    let db = super::linear_acc::matmul_tn_f32(&g, xas)?; // [out, r]
    Ok((dx, da, db))
}

/// m ⊙ x, the mask (f32, any shape of x's size) cast to x's dtype.
fn masked(x: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    match mask {
        Some(m) => x.mul(&m.reshape(x.shape())?.to_dtype(x.dtype())?),
        None => Ok(x.clone()),
    }
}
