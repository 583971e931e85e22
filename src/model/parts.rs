//! Cutting and joining a linear's buffers: a fused linear's outputs cut into its parts (Phi-3's
//! qkv_proj into q, k and v), their gradients joined back, and a group of linears padded into
//! one buffer for the fold (`ops::fold`).

use super::linear::{Linear, Pad};
use crate::ops;
use candle_core::{Result, Tensor};

/// The row blocks of a folded linear's W* [out, in + pad] that make its output's parts: the
/// `cuts` (widths summing to out) of the one linear of a group (`of` linears), or W* whole.
/// Views: a block of rows of a row-major matrix is contiguous.
pub(super) fn row_blocks(w: &Tensor, cuts: &[usize], of: usize) -> Result<Vec<Tensor>> {
    if cuts.is_empty() {
        return Ok(vec![w.clone()]);
    }
    let out = w.dim(0)?;
    if of != 1 || cuts.iter().sum::<usize>() != out {
        candle_core::bail!("parts {cuts:?} of {of} linears, {out} outputs: one fused linear's");
    }
    cut(w, 0, cuts)
}

/// t cut along `dim` into consecutive pieces of the widths `cuts` (views).
pub(super) fn cut(t: &Tensor, dim: usize, cuts: &[usize]) -> Result<Vec<Tensor>> {
    let mut off = 0;
    let mut pieces = Vec::with_capacity(cuts.len());
    for &n in cuts {
        pieces.push(t.narrow(dim, off, n)?);
        off += n;
    }
    Ok(pieces)
}

/// The parts' gradients as the one fused linear's [m, out] (joined along the columns), or as
/// they are without cuts.
pub(super) fn join_parts(g: Vec<Tensor>, cuts: &[usize]) -> Result<Vec<Tensor>> {
    match cuts.is_empty() {
        true => Ok(g),
        false => Ok(vec![Tensor::cat(&g, 1)?]),
    }
}

/// `Model::fold` for one group of linears that share their input: each one's W copied into
/// the first `in` columns of a zeroed [out, in + pad] (`ops::fold::pad_width`), its B's
/// columns after those of the linears before it. Returns the pads' bytes; 0 (nothing done)
/// when the group cannot fold, or is folded already.
pub(super) fn pad_group(lins: &mut [&mut Linear]) -> Result<usize> {
    let mut ranks = Vec::with_capacity(lins.len());
    let mut scale = None;
    for lin in lins.iter() {
        let Some(lora) = lin.lora.as_ref().filter(|l| l.m.is_none()) else {
            return Ok(0); // no adapter, or DoRA's (unfolded: `Linear::shared`)
        };
        if lin.b.is_some() || lin.pad.is_some() || *scale.get_or_insert(lora.scale) != lora.scale {
            return Ok(0);
        }
        ranks.push(lora.a.dim(0)?);
    }
    let in_f = match lins.first() {
        Some(lin) => lin.w.dim(1)?,
        None => return Ok(0),
    };
    let Some(p) = ops::fold::pad_width(&ranks, in_f) else {
        return Ok(0);
    };
    let (mut col, mut bytes) = (0, 0);
    for lin in lins.iter_mut() {
        let (out, in_f) = lin.w.dims2()?;
        let full = Tensor::zeros((out, in_f + p), lin.w.dtype(), lin.w.device())?;
        full.slice_set(&lin.w.contiguous()?, 1, 0)?;
        lin.w = full.narrow(1, 0, in_f)?;
        bytes += out * p * lin.w.dtype().size_in_bytes();
        lin.pad = Some(Pad { full, col, in_f });
        col += lin.lora.as_ref().map_or(0, |l| l.a.dims()[0]);
    }
    Ok(bytes)
}
