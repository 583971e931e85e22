//! DoRA's maths (PEFT's `DoraLinearLayer`, `lora.use_dora`), around an ordinary LoRA linear.
//!
//! With W [out, in] the frozen weight (dequantized for an NF4 base), s the adapter's scale and
//! m [out] the trained magnitude:
//!
//!   n = ‖W + s·B A‖ per output row [out], detached (DoRA §4.3: no gradient flows through n)
//!   g = m / n [out]
//!   z = x Wᵀ + s·x Aᵀ Bᵀ [rows, out] (the LoRA linear without its bias)
//!   y = g ⊙ z + bias
//!
//! Backward, from dy [rows, out]: dm = Σ_rows dy ⊙ z / n; dz = g ⊙ dy, which then takes the
//! ordinary LoRA backward (dx = dz W + s (dz B) A, dA, dB) in place of dy.
//!
//! n is recomputed from A and B wherever it is used (the forward, a recompute, the backward):
//! B A is an [out, r] × [r, in] product, small beside the token GEMMs, and no cache can go
//! stale when the optimiser steps. Everything here runs in f32 whatever the activation dtype
//! (g is near 1: rounded to bf16 it would move every output by up to 0.4%).

use candle_core::{DType, Result, Tensor};

/// ‖w‖ per row: w [out, in] (any float dtype) → [out] f32.
pub(crate) fn row_norms(w: &Tensor) -> Result<Tensor> {
    w.to_dtype(DType::F32)?.sqr()?.sum(1)?.sqrt()
}

/// Elements of W + s·B A made at once by `weight_norm` (16 MiB in f32): its f32 temporaries
/// stay a few of these, not a few copies of W (180 MiB each for Llama-2-7B's MLP in f32).
pub(crate) const CHUNK: usize = 1 << 22;

/// n = ‖W + s·B A‖ per row [out] f32, from W [out, in], A [r, in] and B [out, r] (f32 Vars'
/// tensors; detached here, so no graph reaches them through n), `CHUNK` elements of rows at
/// a time.
pub(crate) fn weight_norm(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    weight_norm_in(w, a, b, scale, CHUNK)
}

/// `weight_norm`, `chunk` elements at a time.
fn weight_norm_in(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64, chunk: usize) -> Result<Tensor> {
    let (out, in_f) = w.dims2()?;
    let (a, b) = (a.detach(), b.detach());
    let rows = (chunk / in_f.max(1)).clamp(1, out.max(1));
    let mut parts = Vec::with_capacity(out.div_ceil(rows));
    for start in (0..out).step_by(rows) {
        let k = rows.min(out - start);
        let ba = b.narrow(0, start, k)?.matmul(&a)?; // [k, in] f32
        let v = (w.narrow(0, start, k)?.to_dtype(DType::F32)? + (ba * scale)?)?;
        parts.push(row_norms(&v)?);
    }
    Tensor::cat(&parts, 0)
}

/// g = m / n [out] f32, m the magnitude's tensor (a graph through it is kept, for the
/// autograd forward), n `weight_norm`'s.
pub(crate) fn magnitude_scale(m: &Tensor, n: &Tensor) -> Result<Tensor> {
    m.broadcast_div(n)
}

/// y = g ⊙ z + bias: z [.., out] in the activation dtype, g [out] f32, bias [out] → z's
/// shape and dtype, in f32 and rounded once.
pub(crate) fn apply(z: &Tensor, g: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = z.to_dtype(DType::F32)?.broadcast_mul(g)?;
    let y = match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?)?,
        None => y,
    };
    y.to_dtype(z.dtype())
}

/// dz = g ⊙ dy: dy [rows, out], g [out] f32 → dy's dtype (contiguous).
pub(crate) fn scale_grad(dy: &Tensor, g: &Tensor) -> Result<Tensor> {
    dy.to_dtype(DType::F32)?
        .broadcast_mul(&g.detach())?
        .to_dtype(dy.dtype())?
        .contiguous()
}

/// dm = Σ_rows dy ⊙ z / n: dy and z [rows, out], n [out] f32 → [out] f32.
pub(crate) fn grad_m(dy: &Tensor, z: &Tensor, n: &Tensor) -> Result<Tensor> {
    let dz = (dy.to_dtype(DType::F32)? * z.to_dtype(DType::F32)?)?;
    dz.sum(0)?.broadcast_div(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The autograd of y = (m / n) ⊙ (x (W + s B A)ᵀ), n detached, against `grad_m` and
    /// `scale_grad`: the hand-written backward is the one autograd gives.
    #[test]
    fn the_hand_written_backward_is_autograds() -> Result<()> {
        let dev = Device::Cpu;
        let t = |v: Vec<f32>, s: (usize, usize)| Tensor::from_vec(v, s, &dev);
        let seq = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<_>>();
        let (rows, out, inf, r, s) = (5, 3, 4, 2, 0.5);
        let w = t(seq(out * inf, 0.7), (out, inf))?;
        let a = t(seq(r * inf, 1.3), (r, inf))?;
        let b = t(seq(out * r, 2.1), (out, r))?;
        let x = Var::from_tensor(&t(seq(rows * inf, 0.9), (rows, inf))?)?;
        let m = Var::from_tensor(&(row_norms(&w)? * 1.1)?)?;
        let dy = t(seq(rows * out, 1.7), (rows, out))?;
        let n = weight_norm(&w, &a, &b, s)?;
        let g = magnitude_scale(m.as_tensor(), &n)?;
        let z = (x.as_tensor().matmul(&w.t()?)?
            + (x.as_tensor().matmul(&a.t()?)?.matmul(&b.t()?)? * s)?)?;
        let y = apply(&z, &g, None)?;
        let grads = (y * &dy)?.sum_all()?.backward()?;
        let max = |p: &Tensor, q: &Tensor| -> Result<f32> {
            (p - q)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        let dm = grad_m(&dy, &z.detach(), &n)?;
        let want_dm = grads.get(m.as_tensor()).cloned();
        let want_dx = grads.get(x.as_tensor()).cloned();
        let (Some(want_dm), Some(want_dx)) = (want_dm, want_dx) else {
            candle_core::bail!("no gradient for m or x");
        };
        assert!(max(&dm, &want_dm)? < 1e-5);
        let dz = scale_grad(&dy, &g)?;
        let dx = (dz.matmul(&w)? + (dz.matmul(&b)?.matmul(&a)? * s)?)?;
        assert!(max(&dx, &want_dx)? < 1e-5);
        // in chunks of rows (2 rows of 4, then 1) as in one piece
        let direct = row_norms(&(&w + (b.matmul(&a)? * s)?)?)?;
        assert!(max(&weight_norm_in(&w, &a, &b, s, 8)?, &direct)? < 1e-6);
        assert!(max(&n, &direct)? < 1e-6);
        Ok(())
    }
}
