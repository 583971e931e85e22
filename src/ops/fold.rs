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
//!   - the kernel that makes x (RMSNorm, the residual add's RMSNorm, SwiGLU) writes it into the
//!     first `in` columns of a fresh [m, in + pad], and the adapters' xas go into the next.
//!
//! Linears that share their input (q, k, v; gate, up) share the pad: its first Σ r columns
//! hold their B's (each W*'s zero but for its own) and their xas side by side in x's (one
//! GEMM makes them, as unfolded); rows are whole multiples of `ROW_ALIGN`.
//!
//! **The sum is rounded once.** Unfolded, the base GEMM added the adapter's bf16 term in its
//! β = 1 epilogue, and its outputs were up to a whole bf16 step off the f32 products (the
//! base's rounding, then the sum's: a GPU test measures both); an adapter term under half a
//! step of the output, as early in training at small learning rates, was then mostly lost.
//! Folded, y is within half a step: on the 7B bench (lr 1e-4) the loss after the second step
//! fell to 10.996 instead of 11.144 (from 11.179), each folded group adding to it.
//!
//! Measured (7B, micro-batch 2 × 2048, r16, one H200; BENCHMARKS.md (q)): the bench +0.4% to
//! +1.1% against two GEMMs (a PyTorch probe of the layer's products had bounded it at ~6.6 ms
//! a step); the pads +150 MiB.
//!
//! Not folded (two GEMMs as before): LORA_TRAIN_FOLD=0; FSDP (its gathered layers are flat
//! buffers of the checkpoint's shapes); o_proj (its input comes out of the flash kernel);
//! dropout (each adapter's own mask); linears with a bias; the CPU.

use super::linear_acc::matmul_scaled;
use candle_core::{DType, Result, Tensor};

/// Whether a model of `dtype` on CUDA (`cuda`) or elsewhere folds: bf16 on CUDA (the padded
/// kernels' type), unless LORA_TRAIN_FOLD=0 (for A/B runs). `Model::fold` and the memory plan
/// both ask here.
pub fn takes(cuda: bool, dtype: DType) -> bool {
    cuda && dtype == DType::BF16 && std::env::var("LORA_TRAIN_FOLD").map_or(true, |v| v != "0")
}

/// Padded rows are whole multiples of this many elements (128 bytes in bf16). cuBLAS's
/// choices for a weight read through a row stride that is not (4128 at gate and up, 7B r16)
/// ran their dL/dx products 10% slower (ncu: 504 against 457 µs).
pub const ROW_ALIGN: usize = 64;

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
pub fn rms_norm_pad(x: &Tensor, w: &Tensor, eps: f64, pad: usize) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::rms_norm_pad(x, w, eps as f32, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, w, eps, pad);
        Ok(None)
    }
}

/// `ops::add_rms_norm` (h = x + a, then rms_norm(h) · w) with the normed rows padded as in
/// `rms_norm_pad`: (h as x's shape, [rows, d + pad]); None as there.
pub fn add_rms_norm_pad(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f64,
    pad: usize,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::add_rms_norm_pad(x, a, w, eps as f32, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, a, w, eps, pad);
        Ok(None)
    }
}

/// `ops::swiglu(g, u)` for g, u [.., d] into the first d columns of a fresh [rows, d + pad];
/// None as `rms_norm_pad`.
pub fn swiglu_pad(g: &Tensor, u: &Tensor, pad: usize) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::swiglu_pad(g, u, pad)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (g, u, pad);
        Ok(None)
    }
}

/// The folded forward of linears that share their input: xp [m, in + pad] with x in its
/// first `in` columns (the next Σ r are written here), a their A's stacked [Σ r, in] in xp's
/// dtype, s their one scale, ws their padded weights W*_i [out_i, in + pad] (B's in place) →
/// (y_i [m, out_i] each, xas = s · x Aᵀ [m, Σ r]: each one's adapter state is its column
/// slice). The products run over k = in + Σ r.
pub fn fwd(
    xp: &Tensor,
    in_f: usize,
    a: &Tensor,
    scale: f64,
    ws: &[&Tensor],
) -> Result<(Vec<Tensor>, Tensor)> {
    let x = xp.narrow(1, 0, in_f)?; // [m, in], rows in + pad apart
    let xas = matmul_scaled(&x, a, true, scale)?; // [m, Σ r], as unfolded
    xp.slice_set(&xas, 1, in_f)?;
    let k = in_f + xas.dim(1)?;
    let xk = xp.narrow(1, 0, k)?; // [x | xas]
    let ys = ws
        .iter()
        .map(|w| matmul_scaled(&xk, &w.narrow(1, 0, k)?, true, 1.0)) // [x | xas] · [W | B]ᵀ
        .collect::<Result<Vec<_>>>()?;
    Ok((ys, xas))
}
