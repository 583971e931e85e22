//! The LoRA linear as one graph node: y = x Wᵀ (+ b) + s · (m ⊙ x) Aᵀ Bᵀ.
//!
//! x: [..., in], W: [out, in] frozen, A: [r, in] and B: [out, r] f32 trainable, m an optional
//! dropout mask over x (`ops::dropout`: drawn where it is used, never stored), s the scale.
//! Autograd keeps x, A, B and y only (a chain of candle ops would keep every intermediate:
//! x Wᵀ, x Aᵀ, (x Aᵀ) Bᵀ, its scaled copy, the sum).
//! Backward (g = dL/dy, xd = m ⊙ x, xas = s · xd Aᵀ kept from forward: [m, r]):
//!   dx = g W + s · ((g B) A) ⊙ m,   dA = s · (g B)ᵀ xd,   dB = gᵀ xas
//!
//! Every function takes the run's `Gemm` (`Kernels::gemm`), which its GEMMs run on.

use super::attach::attach3;
use super::dropout::Dropout;
use super::frozen_linear::frozen_linear;
use super::kernels::Gemm;
use super::linear_acc::matmul_scaled;
use candle_core::{Result, Tensor};

/// y = x Wᵀ (+ b) + s · (m ⊙ x) Aᵀ Bᵀ, differentiable in x, A and B (see the module docs):
/// x [..., in], `w` [out, in], `a` [r, in], `b` [out, r], `scale` s, `dropout` drawing m.
#[allow(clippy::too_many_arguments)]
pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<Dropout>,
    gemm: Gemm,
) -> Result<Tensor> {
    let in_f = *x.dims().last().unwrap_or(&0);
    let out_f = w.dim(0)?;
    let x2 = x.detach().reshape(((), in_f))?; // [m, in]
    let (y, xas) = lora_fwd(
        &x2,
        w,
        bias,
        &a.detach(),
        &b.detach(),
        scale,
        dropout.as_ref(),
        gemm,
    )?;
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = out_f;
    }
    let y = y.reshape(dims)?;
    let w = w.clone();
    let backward = move |x: &Tensor, a: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor| {
        let x2 = x.reshape(((), in_f))?;
        let g = g.reshape(((), out_f))?;
        let (dx, da, db) = lora_bwd(&x2, &g, &w, a, b, scale, dropout.as_ref(), &xas, None, gemm)?;
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn lora_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<&Dropout>,
    gemm: Gemm,
) -> Result<(Tensor, Tensor)> {
    let xas = lora_xas(x, a, scale, dropout, gemm)?; // [m, r]
    Ok((with_base(x, w, bias, &xas, b, gemm)?, xas))
}

/// y = x Wᵀ (+ bias) + xas Bᵀ: x [m, in], xas [m, r] (a column slice is fine) → [m, out]:
/// `lora_fwd`'s output from its kept adapter state (a recompute needs no x Aᵀ again).
pub(crate) fn with_base(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    xas: &Tensor,
    b: &Tensor,
    gemm: Gemm,
) -> Result<Tensor> {
    // Detached: the adapters are Vars, and a graph through them would keep every activation.
    let bd = b.detach().to_dtype(x.dtype())?;
    // The adapter's term alone (full bf16 precision however small), then the base GEMM adds
    // onto it in f32 (its epilogue): one rounding of the sum, at the base output's scale.
    let lora = matmul_scaled(xas, &bd, true, 1.0, gemm)?; // [m, out]
    match bias {
        None => super::linear_acc::linear_acc(x, w, lora, gemm), // the base GEMM adds onto it
        Some(_) => super::add(&frozen_linear(x, w, bias)?, &lora),
    }
}

/// The adapter's half of `lora_fwd`'s state alone: xas = s · (m ⊙ x) Aᵀ [m, r] (what a
/// recomputed layer's backward needs of a linear whose output it does not). With dropout the
/// mask is drawn inside the product where a kernel can (`ops::fold_drop`).
pub(crate) fn lora_xas(
    x: &Tensor,
    a: &Tensor,
    scale: f64,
    dropout: Option<&Dropout>,
    gemm: Gemm,
) -> Result<Tensor> {
    let ad = a.detach().to_dtype(x.dtype())?;
    match dropout {
        Some(d) => super::fold_drop::xas(x, &ad, std::slice::from_ref(d), scale, gemm),
        None => matmul_scaled(x, &ad, true, scale, gemm), // scaled while small
    }
}

/// One LoRA linear of a group that shares its input (`lora_fwd_shared`, `lora_bwd_shared`):
/// W [out, in] frozen, optional bias, A [r, in], B [out, r], scale s. No dropout.
pub(crate) struct Adapter<'a> {
    pub(crate) w: &'a Tensor,
    pub(crate) bias: Option<&'a Tensor>,
    pub(crate) a: &'a Tensor,
    pub(crate) b: &'a Tensor,
    pub(crate) scale: f64,
}

/// `lora_fwd` of linears that share their input x [m, in] and one scale s, with `a` their A's
/// stacked [Σ r, in] in x's dtype: s · x Aᵀ for all of them is one GEMM [m, Σ r], and each
/// linear's xas is its column slice of it (kept as such: one buffer for the group).
pub(crate) fn lora_fwd_shared(
    x: &Tensor,
    ads: &[Adapter],
    a: &Tensor,
    gemm: Gemm,
) -> Result<Vec<(Tensor, Tensor)>> {
    let scale = ads.first().map_or(1.0, |ad| ad.scale);
    let xas = matmul_scaled(x, a, true, scale, gemm)?; // [m, Σ r]
    let mut off = 0;
    let mut out = Vec::with_capacity(ads.len());
    for ad in ads {
        let r = ad.a.dim(0)?;
        let xas_i = xas.narrow(1, off, r)?; // [m, r], row stride Σ r
        off += r;
        out.push((with_base(x, ad.w, ad.bias, &xas_i, ad.b, gemm)?, xas_i));
    }
    Ok(out)
}

/// The backward of `lora_fwd_shared`: x [m, in], g[i] = dL/dy_i [m, out_i] (consumed: each is
/// freed after its last GEMM), xas[i] what the forward kept, `a` the stacked A's → (dL/dx
/// [m, in] summed over the linears, (dA_i f32, dB_i f32) each). The products s · g_i B_i sit
/// side by side [m, Σ r], so that their dL/dx terms are one GEMM against the stacked A's (the
/// base GEMMs then accumulate onto it) and their dA one GEMM against x.
pub(crate) fn lora_bwd_shared(
    x: &Tensor,
    g: Vec<Tensor>,
    ads: &[Adapter],
    xas: &[&Tensor],
    a: &Tensor,
    gemm: Gemm,
) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
    use super::linear_acc::linear_bwd_acc;
    let (gbs, db) = shared_gbs(x.dtype(), &g, ads, xas, gemm)?;
    let mut dx = matmul_scaled(&gbs, a, false, 1.0, gemm)?; // Σ s · (g_i B_i) A_i [m, in]
    for (g, ad) in g.into_iter().zip(ads) {
        dx = linear_bwd_acc(&g, ad.w, dx, gemm)?; // + g_i W_i, in the GEMM; g_i is dropped here
    }
    Ok((dx, shared_grads(x, &gbs, ads, db, gemm)?))
}

/// `lora_bwd_shared`'s adapter gradients alone, without dL/dx (whose GEMMs, the base ones
/// above all, are most of the backward): for an input that needs no gradient, as the first
/// layer's (the frozen embedding's output).
pub(crate) fn lora_grads_shared(
    x: &Tensor,
    g: Vec<Tensor>,
    ads: &[Adapter],
    xas: &[&Tensor],
    gemm: Gemm,
) -> Result<Vec<(Tensor, Tensor)>> {
    let (gbs, db) = shared_gbs(x.dtype(), &g, ads, xas, gemm)?;
    drop(g);
    shared_grads(x, &gbs, ads, db, gemm)
}

/// The products s · g_i B_i side by side [m, Σ r] in `dt`, and each dB_i = g_iᵀ xas_i (f32).
fn shared_gbs(
    dt: candle_core::DType,
    g: &[Tensor],
    ads: &[Adapter],
    xas: &[&Tensor],
    gemm: Gemm,
) -> Result<(Tensor, Vec<Tensor>)> {
    use super::linear_acc::matmul_tn_f32;
    let (mut gbs, mut db) = (Vec::with_capacity(ads.len()), Vec::with_capacity(ads.len()));
    for ((g, ad), xas) in g.iter().zip(ads).zip(xas) {
        let bd = ad.b.detach().to_dtype(dt)?;
        gbs.push(matmul_scaled(g, &bd, false, ad.scale, gemm)?); // s · g_i B_i [m, r_i]
        db.push(matmul_tn_f32(g, xas, gemm)?); // dB_i = g_iᵀ xas_i [out_i, r_i]
    }
    Ok((Tensor::cat(&gbs, 1)?, db))
}

/// Each (dA_i, dB_i): the dA's are one GEMM (gbs [m, Σ r])ᵀ x [m, in] → [Σ r, in] f32, split by
/// rank.
fn shared_grads(
    x: &Tensor,
    gbs: &Tensor,
    ads: &[Adapter],
    db: Vec<Tensor>,
    gemm: Gemm,
) -> Result<Vec<(Tensor, Tensor)>> {
    let da = super::linear_acc::matmul_tn_f32(gbs, x, gemm)?; // [Σ r, in] f32
    let mut off = 0;
    let mut grads = Vec::with_capacity(ads.len());
    for (ad, db) in ads.iter().zip(db) {
        let r = ad.a.dim(0)?;
        grads.push((da.narrow(0, off, r)?, db));
        off += r;
    }
    Ok(grads)
}

/// The backward: x [m, in] (unmasked), g = dL/dy [m, out], `xas` from `lora_fwd`, and `acc`
/// another term of dL/dx to add in (consumed: the sum of several linears' dL/dx, as q, k and
/// v share their input) → (dx [m, in] in x's dtype, dA [r, in] f32, dB [out, r] f32). With
/// dropout, the base GEMM's dL/dx comes first and the adapter's masked term and dA follow in
/// one pass over x and dL/dx (`ops::fold_drop::bwd`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn lora_bwd(
    x: &Tensor,
    g: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<&Dropout>,
    xas: &Tensor,
    acc: Option<Tensor>,
    gemm: Gemm,
) -> Result<(Tensor, Tensor, Tensor)> {
    use super::linear_acc::{linear_bwd_acc, matmul_tn_f32};
    let g = g.contiguous()?;
    if let Some(d) = dropout {
        let dx = match acc {
            Some(acc) => linear_bwd_acc(&g, w, acc, gemm)?, // acc + g W
            None => matmul_scaled(&g, w, false, 1.0, gemm)?, // g W
        };
        let gbs = lora_gbs(&g, b, scale, gemm)?; // s · g B [m, r]
        let ad = a.detach().to_dtype(g.dtype())?;
        let (dx, da) = super::fold_drop::bwd(x, dx, &gbs, &ad, &[*d], 1.0, gemm)?;
        return Ok((dx, da, matmul_tn_f32(&g, xas, gemm)?));
    }
    let (dx, gbs) = lora_bwd_dx(&g, w, a, b, scale, None, acc, gemm)?;
    let (da, db) = lora_grads(x, &g, &gbs, None, xas, gemm)?;
    Ok((dx, da, db))
}

/// s · g B [m, r] in g's dtype, from g = dL/dy [m, out]: what the adapter's dA and dL/dx
/// terms multiply.
pub(crate) fn lora_gbs(g: &Tensor, b: &Tensor, scale: f64, gemm: Gemm) -> Result<Tensor> {
    let bd = b.detach().to_dtype(g.dtype())?;
    matmul_scaled(g, &bd, false, scale, gemm)
}

/// `lora_bwd`'s first half, which needs no x: g [m, out] → (dx [m, in], gbs = s · g B [m, r],
/// what `lora_grads` takes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn lora_bwd_dx(
    g: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
    dropout: Option<&Dropout>,
    acc: Option<Tensor>,
    gemm: Gemm,
) -> Result<(Tensor, Tensor)> {
    use super::linear_acc::linear_bwd_acc;
    let ad = a.detach().to_dtype(g.dtype())?;
    let gbs = lora_gbs(g, b, scale, gemm)?;
    let dlora = match (dropout, acc) {
        (None, Some(acc)) => linear_bwd_acc(&gbs, &ad, acc, gemm)?, // acc + gbs A, one pass
        (dropout, acc) => {
            let d = masked(&gbs.matmul(&ad)?, dropout)?; // [m, in]
            match acc {
                Some(acc) => super::add(&acc, &d)?,
                None => d,
            }
        }
    };
    Ok((linear_bwd_acc(g, w, dlora, gemm)?, gbs)) // g W + dlora
}

/// `lora_bwd`'s second half: the adapter's gradients from x [m, in] (unmasked), g [m, out] and
/// `lora_bwd_dx`'s gbs → (dA [r, in] f32, dB [out, r] f32), straight out of the GEMMs in f32
/// on CUDA (elsewhere a product and a cast).
pub(crate) fn lora_grads(
    x: &Tensor,
    g: &Tensor,
    gbs: &Tensor,
    dropout: Option<&Dropout>,
    xas: &Tensor,
    gemm: Gemm,
) -> Result<(Tensor, Tensor)> {
    let da = super::linear_acc::matmul_tn_f32(gbs, &masked(x, dropout)?, gemm)?; // [r, in]
    let db = super::linear_acc::matmul_tn_f32(g, xas, gemm)?; // [out, r]
    Ok((da, db))
}

/// m ⊙ x (`ops::dropout::apply`: in f32, rounded once to x's dtype), or x.
fn masked(x: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
    match dropout {
        Some(d) => super::dropout::apply(x, d),
        None => Ok(x.clone()),
    }
}
