//! The adapters' forward products folded into the frozen GEMMs by concatenating k (CUDA, bf16).
//!
//! A LoRA linear's forward, y = x Wᵀ + xas Bᵀ with xas = s · x Aᵀ [m, r], is two GEMMs: the
//! adapter's writes a full-width [m, out] term, which the base GEMM reads back (β = 1). Both
//! are one product over a longer k: y = [x | xas] · [W | B]ᵀ. So:
//!
//!   - at load, each folded linear's W [out, in] moves into a wider buffer W* [out, in + pad]
//!     (`Linear::pad`); `Linear::w` is the view of its first `in` columns, which every other
//!     product (the backward's g W) reads with W*'s row stride;
//!   - each micro-batch, its B is rounded to bf16 into its own r pad columns (`Model::ctx`,
//!     one launch for every adapter);
//!   - the kernel that makes x (RMSNorm, the residual add's RMSNorm, SwiGLU, GeGLU) writes it
//!     into the first `in` columns of a fresh [m, in + pad], and the adapters' xas go into the
//!     next.
//!
//! Linears that share their input (q, k, v; gate, up) share the pad: its first Σ r columns
//! hold their B's (each W*'s zero but for its own) and their xas side by side in x's (one
//! GEMM makes them, as unfolded); rows are whole multiples of `ROW_ALIGN`.
//!
//! **The sum is rounded once.** Unfolded, the base GEMM added the adapter's bf16 term in its
//! β = 1 epilogue, and its outputs were up to a whole bf16 step off the f32 products (the
//! base's rounding, then the sum's: a GPU test measures both); an adapter term under half a
//! step of the output, as early in training at small learning rates, was then mostly lost.
//! Folded, y is within half a step.
//!
//! **The backward runs against the same W*'s**: g · W* is dL/dx in its first `in` columns and
//! each adapter's g B in its own pad columns (the other linears' are zero in W*), so no skinny
//! GEMM reads g for it (`Linear::bwd_folded`); s·(g B)·A joins dL/dx in the same buffer and
//! RMSNorm's backward reads its padded rows. down_proj's backward and the gated activation's
//! (SwiGLU or GeGLU) are one GEMM and one kernel (`glu_down_bwd`, fold_bwd.cu).
//!
//! Under FSDP the shards hold the padded weights, and each rank writes the B's into the pad
//! columns of the rows its shards hold (`train::shards::Shards::write_pads`): a gathered layer
//! arrives folded.
//!
//! **Dropout keeps the fold**: the frozen half reads x and the pad columns the adapters' masked
//! xas_i = s · (m_i ⊙ x) A_iᵀ, each linear's own mask drawn inside the kernel that makes them
//! (`ops::fold_drop`); the backward's adapter terms take the same masks (its dL/dx term and dA
//! in one pass, and down's in `glu_down_bwd`).
//!
//! Folded where `Kernels::fold` says (CUDA, bf16). Not folded (two GEMMs, the CPU's path):
//! o_proj (its input comes out of the flash kernel); linears with a bias; groups not all
//! adapted alike.

use super::dropout::Dropout;
use super::glu::Act;
use super::kernels::Gemm;
use super::linear_acc::matmul_scaled;
use super::rms_norm::NormSpec;
use candle_core::{Result, Tensor};

/// Padded rows are whole multiples of this many elements (128 bytes in bf16): a weight read
/// through a row stride that is not a multiple of 64 elements slows cuBLAS's dL/dx products.
pub(crate) const ROW_ALIGN: usize = 64;

/// The pad a group of adapted linears that share an input of `in_f` columns, of ranks
/// `ranks`, is given: rows of `in_f` + pad = `in_f` + Σ r rounded up to `ROW_ALIGN` (the
/// columns past in + Σ r are neither written nor read). None where the kernels cannot take the rows (`in_f` not a
/// multiple of 8).
pub fn pad_width(ranks: &[usize], in_f: usize) -> Option<usize> {
    let p: usize = ranks.iter().sum();
    (!ranks.is_empty() && in_f % 8 == 0).then(|| (in_f + p).next_multiple_of(ROW_ALIGN) - in_f)
}

/// rms_norm(x) · w for x [.., d] into the first d columns of a fresh [rows, d + pad] (its pad
/// columns unset); None off CUDA or where the kernel cannot take the operands.
pub fn rms_norm_pad(
    x: &Tensor,
    w: &Tensor,
    spec: impl Into<NormSpec>,
    pad: usize,
) -> Result<Option<Tensor>> {
    let spec = spec.into();
    #[cfg(feature = "cuda")]
    {
        super::rms_norm::cuda::rms_norm_pad(x, w, spec, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, w, spec, pad);
        Ok(None)
    }
}

/// `ops::add_rms_norm` (h = x + a, then rms_norm(h) · w) with the normed rows padded as in
/// `rms_norm_pad`: (h as x's shape, [rows, d + pad]); None as there.
pub fn add_rms_norm_pad(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    spec: impl Into<NormSpec>,
    pad: usize,
) -> Result<Option<(Tensor, Tensor)>> {
    let spec = spec.into();
    #[cfg(feature = "cuda")]
    {
        super::rms_norm::cuda::add_rms_norm_pad(x, a, w, spec, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, a, w, spec, pad);
        Ok(None)
    }
}

/// `act.glu(g, u)` for g, u [.., d] into the first d columns of a fresh [rows, d + pad];
/// None as `rms_norm_pad`.
pub fn glu_pad(act: Act, g: &Tensor, u: &Tensor, pad: usize) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        super::glu::cuda::glu_pad(&format!("{}_pad_v8_bf16", act.kernel()), g, u, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (act, g, u, pad);
        Ok(None)
    }
}

/// What `glu_down_bwd` gives.
pub struct GluDownGrads {
    /// dL/dgate [m, I].
    pub dg: Tensor,
    /// dL/dup [m, I].
    pub du: Tensor,
    /// down's dA [r, I] f32.
    pub da: Tensor,
}

/// down_proj's backward folded, with the gated activation's (`act`: SwiGLU or GeGLU), in one
/// pass after one GEMM (fold_bwd.cu): dy = dL/dy [m, out], down's padded weight W*
/// [out, I + pad] (its B in the r pad columns at `col`), gate g and up u [m, I], down's A
/// [r, I] in bf16 and its scale s → dL/dg, dL/du and down's dA. The GEMM dy · W* gives dy·W
/// and g_B = dy·B side by side; the kernel adds s·g_B·A to dL/da in f32, runs the
/// activation's backward and sums dA = s·g_Bᵀ·a with a, down's input, recomputed. Unfolded
/// the same took four more passes over [m, I]: s·g_B·A written and read back by the base
/// GEMM, a written and read by dA's GEMM. dB = dyᵀ·xas is the caller's. With down's dropout,
/// its mask m is drawn in the same pass: s·(g_B·A)⊙m joins dL/da and dA = s·g_Bᵀ·(m ⊙ a).
/// None (nothing run) off CUDA, or where the kernel cannot take the operands (r > 64, widths
/// not multiples of 8). `gemm` runs the GEMM.
#[allow(clippy::too_many_arguments)]
pub fn glu_down_bwd(
    act: Act,
    dy: &Tensor,
    w_full: &Tensor,
    col: usize,
    g: &Tensor,
    u: &Tensor,
    a: &Tensor,
    scale: f64,
    dropout: Option<&Dropout>,
    gemm: Gemm,
) -> Result<Option<GluDownGrads>> {
    #[cfg(feature = "cuda")]
    {
        cuda::glu_down_bwd(act, dy, w_full, col, g, u, a, scale, dropout, gemm)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (act, dy, w_full, col, g, u, a, scale, dropout, gemm);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Act, GluDownGrads};
    use crate::ops::cuda::{addr, function, uninit};
    use crate::ops::dropout::{DropKey, Dropout};
    use crate::ops::kernels::Gemm;
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{DType, Device, Result, Tensor};

    /// fold_bwd.cu's GluLoraP.
    #[repr(C)]
    struct GluLoraP {
        g: u64,
        u: u64,
        dap: u64,
        a: u64,
        out: u64,
        part: u64,
        ld: i64,
        m: i32,
        i: i32,
        gb_off: i32,
        gb_n: i32,
        r: i32,
        s: f32,
        d: DropKey,
    }
    // SAFETY: plain old data laid out as the C struct the kernel takes by value.
    unsafe impl DeviceRepr for GluLoraP {}

    /// Tokens a block: the partial dA's are ⌈m / 256⌉ [r, I] slices (4096 tokens: 16, 11 MiB
    /// at 7B r16).
    const TOKENS: usize = 256;

    /// What the kernel is given of the operands: m tokens, I columns, rank r, W*'s row length
    /// ld and g_B's first column in dy · W*'s rows; g's, u's and A's addresses.
    struct Operands {
        m: usize,
        i: usize,
        r: usize,
        ld: usize,
        gb_off: usize,
        ptrs: [u64; 3],
    }

    /// `glu_down_bwd`'s operands checked: None where the kernel cannot take them (not bf16,
    /// shapes that disagree, widths not multiples of 8, r outside 1..=64, no tokens, operands
    /// not 4-byte aligned, sizes past i32).
    fn operands(
        dy: &Tensor,
        w_full: &Tensor,
        col: usize,
        g: &Tensor,
        u: &Tensor,
        a: &Tensor,
    ) -> Result<Option<Operands>> {
        let bf16 = [dy, w_full, g, u, a]
            .iter()
            .all(|t| t.dtype() == DType::BF16);
        let (Ok((m, i)), Ok((r, ai)), Ok((out, ld)), Ok((dm, dout))) =
            (g.dims2(), a.dims2(), w_full.dims2(), dy.dims2())
        else {
            return Ok(None);
        };
        let gb_off = i + col;
        let fits = u.dims() == g.dims() && ai == i && dm == m && dout == out;
        let widths = i % 8 == 0 && ld % 8 == 0 && gb_off % 8 == 0 && gb_off + r <= ld;
        let ints = [m, i, gb_off, ld].iter().all(|&n| i32::try_from(n).is_ok());
        if !bf16 || !fits || !widths || !ints || !(1..=64).contains(&r) || m == 0 {
            return Ok(None);
        }
        let (Some(gp), Some(up), Some(ap)) = (addr(g)?, addr(u)?, addr(a)?) else {
            return Ok(None);
        };
        if gp % 4 != 0 || up % 4 != 0 || ap % 4 != 0 {
            return Ok(None);
        }
        Ok(Some(Operands {
            m,
            i,
            r,
            ld,
            gb_off,
            ptrs: [gp, up, ap],
        }))
    }

    /// fold_bwd.cu's kernel for `act` at rank r, with or without dropout.
    fn kernel_name(act: Act, r: usize, dropout: bool) -> String {
        let kernel = match (r, dropout) {
            (..=16, false) => "lora_r16",
            (17..=32, false) => "lora_r32",
            (_, false) => "lora_r64",
            (..=16, true) => "lora_drop_r16",
            (17..=32, true) => "lora_drop_r32",
            (_, true) => "lora_drop_r64",
        };
        format!("{}_{kernel}", act.kernel())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn glu_down_bwd(
        act: Act,
        dy: &Tensor,
        w_full: &Tensor,
        col: usize,
        g: &Tensor,
        u: &Tensor,
        a: &Tensor,
        scale: f64,
        dropout: Option<&Dropout>,
        gemm: Gemm,
    ) -> Result<Option<GluDownGrads>> {
        let Device::Cuda(dev) = g.device() else {
            return Ok(None);
        };
        let Some(Operands {
            m,
            i,
            r,
            ld,
            gb_off,
            ptrs: [gp, up, ap],
        }) = operands(dy, w_full, col, g, u, a)?
        else {
            return Ok(None);
        };
        // dy · W*: dy·W [m, I], then g_B = dy·B and zeros (W*'s other pad columns are zero)
        let dap = super::matmul_scaled(dy, w_full, false, 1.0, gemm)?; // [m, ld]
        let Some(dp) = addr(&dap)? else {
            return Ok(None);
        };
        let parts = m.div_ceil(TOKENS);
        // SAFETY: the kernel writes every element of each: dg and du at every (token, column)
        // of [m, I], and each block row its [r, I] slice of the parts; the sum every dA.
        let (Some(both), Some(part), Some(da)) = (unsafe {
            (
                uninit(dev, DType::BF16, (2, m, i))?,
                uninit(dev, DType::F32, (parts, r, i))?,
                uninit(dev, DType::F32, (r, i))?,
            )
        }) else {
            return Ok(None);
        };
        let (Some(op), Some(pp), Some(dap_)) = (addr(&both)?, addr(&part)?, addr(&da)?) else {
            return Ok(None);
        };
        // (operands() bounded m, I, gb_off and ld by i32; r is at most 64)
        let p = GluLoraP {
            g: gp,
            u: up,
            dap: dp,
            a: ap,
            out: op,
            part: pp,
            ld: ld as i64,
            m: m as i32,
            i: i as i32,
            gb_off: gb_off as i32,
            gb_n: (ld - gb_off) as i32,
            r: r as i32,
            s: scale as f32,
            d: DropKey::of(dropout),
        };
        let func = function(dev, &kernel_name(act, r, dropout.is_some()))?;
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (i.div_ceil(64) as u32, parts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&p);
        // SAFETY: every address is a live buffer of the size checked above (g, u [m, I], dap
        // [m, ld], a [r, I], the outputs fresh), on this stream.
        unsafe { b.launch(cfg) }.w()?;
        let n = (r * i) as i64;
        let (sum, pi) = (function(dev, "sum_parts_f32")?, parts as i32);
        let mut b = stream.launch_builder(&sum);
        b.arg(&pp).arg(&dap_).arg(&pi).arg(&n);
        // SAFETY: part holds `parts` slices of n f32, da n; both ours, on this stream.
        unsafe { b.launch(crate::ops::cuda::elems(n as usize)?) }.w()?;
        drop((dap, part));
        Ok(Some(GluDownGrads {
            dg: both.get(0)?,
            du: both.get(1)?,
            da,
        }))
    }
}

/// The folded forward of linears that share their input: xp [m, in + pad] with x in its
/// first `in` columns (the next Σ r are written here), a their A's stacked [Σ r, in] in xp's
/// dtype, s their one scale, `drops` each one's dropout (empty: none), ws their padded weights
/// W*_i [out_i, in + pad] (B's in place) → (y_i [m, out_i] each, xas = s · (m_i ⊙ x) A_iᵀ
/// side by side [m, Σ r]: each one's adapter state is its column slice). The products run
/// over k = in + Σ r, on `gemm`.
pub(crate) fn fwd(
    xp: &Tensor,
    in_f: usize,
    a: &Tensor,
    scale: f64,
    drops: &[Dropout],
    ws: &[&Tensor],
    gemm: Gemm,
) -> Result<(Vec<Tensor>, Tensor)> {
    let x = xp.narrow(1, 0, in_f)?; // [m, in], rows in + pad apart
    let xas = match drops.is_empty() {
        true => matmul_scaled(&x, a, true, scale, gemm)?, // [m, Σ r], as unfolded
        false => super::fold_drop::xas(&x, a, drops, scale, gemm)?, // masked, one pass over x
    };
    xp.slice_set(&xas, 1, in_f)?;
    let k = in_f + xas.dim(1)?;
    let xk = xp.narrow(1, 0, k)?; // [x | xas]
    let ys = ws
        .iter()
        .map(|w| matmul_scaled(&xk, &w.narrow(1, 0, k)?, true, 1.0, gemm)) // [x | xas] · [W | B]ᵀ
        .collect::<Result<Vec<_>>>()?;
    Ok((ys, xas))
}
