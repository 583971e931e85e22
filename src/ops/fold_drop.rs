//! The adapters' products under LoRA dropout, for linears that share their input x [m, in]
//! (q, k, v; gate, up; or one linear), each with its own mask m_j (`ops::dropout`; the scale
//! s = α / r and m_j ⊙ x = dropout_j(x)):
//!
//!   forward   xas_j = s · (m_j ⊙ x) A_jᵀ                                     [m, r]
//!   backward  dL/dx += s · (gB_j A_j) ⊙ m_j,   dA_j = s · gB_jᵀ (m_j ⊙ x)    gB_j = g_j B_j
//!
//! On CUDA (bf16, `Dropout::fused`) each is one kernel over the group (fold_drop.cu) that
//! draws the masks in registers: x is read once and dL/dx read and written once, as by the
//! GEMMs these stand for without dropout (`ops::fold`), and m ⊙ x is never stored. The fold
//! thereby stays on with dropout: the frozen GEMM reads x, the pad columns the masked xas.
//! Elsewhere, or where the kernels cannot take the operands (ranks not a multiple of 8 or over
//! 64, widths not multiples of 8), each linear's masked copies (`dropout::apply`) and GEMMs:
//! the same values to rounding, on any device.

use super::dropout::{apply, Dropout};
use super::kernels::Gemm;
use super::linear_acc::{matmul_scaled, matmul_tn_f32};
use candle_core::{Result, Tensor};

/// The forward's adapter states of linears that share x [m, in] (a column slice of wider rows
/// is fine: the fold's padded rows): `a` their A's stacked [n·r, in] in x's dtype, one
/// `Dropout` each, s their scale → xas [m, n·r] (each one's its r columns), in x's dtype.
pub fn xas(x: &Tensor, a: &Tensor, drops: &[Dropout], scale: f64, gemm: Gemm) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if drops.iter().all(|d| d.fused) {
        if let Some(y) = cuda::xas(x, a, drops, scale)? {
            return Ok(y);
        }
    }
    let r = rank_of(a, drops.len())?;
    let mut parts = Vec::with_capacity(drops.len());
    for (j, d) in drops.iter().enumerate() {
        let xd = apply(&x.contiguous()?, d)?; // [m, in]
        parts.push(matmul_scaled(
            &xd,
            &a.narrow(0, j * r, r)?,
            true,
            scale,
            gemm,
        )?);
    }
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Tensor::cat(&parts, 1),
    }
}

/// The backward's adapter terms of linears that share x [m, in]: `dx` dL/dx so far [m, in]
/// (consumed: on CUDA its rows are written in place, so it must be a fresh result nothing else
/// holds; a column slice of wider rows is fine), gb = g_j B_j side by side [m, n·r] (unscaled;
/// a column slice is fine), `a` their A's stacked [n·r, in], one `Dropout` each, s their scale
/// → (dx + Σ_j s · (gB_j A_j) ⊙ m_j [m, in], dA = s · gB_jᵀ (m_j ⊙ x) stacked [n·r, in] f32).
pub fn bwd(
    x: &Tensor,
    dx: Tensor,
    gb: &Tensor,
    a: &Tensor,
    drops: &[Dropout],
    scale: f64,
    gemm: Gemm,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if drops.iter().all(|d| d.fused) {
        if let Some(da) = cuda::bwd(x, &dx, gb, a, drops, scale)? {
            return Ok((dx, da));
        }
    }
    let r = rank_of(a, drops.len())?;
    let (mut dx, mut da) = (dx, Vec::with_capacity(drops.len()));
    let x = x.contiguous()?;
    for (j, d) in drops.iter().enumerate() {
        let (gbj, aj) = (gb.narrow(1, j * r, r)?, a.narrow(0, j * r, r)?);
        let term = apply(&matmul_scaled(&gbj, &aj, false, scale, gemm)?, d)?; // [m, in]
        dx = super::add(&dx.contiguous()?, &term)?;
        da.push((matmul_tn_f32(&gbj, &apply(&x, d)?, gemm)? * scale)?); // [r, in]
    }
    let da = match da.len() {
        1 => da.remove(0),
        _ => Tensor::cat(&da, 0)?,
    };
    Ok((dx, da))
}

/// The rank of each of `n` A's stacked in `a` [n·r, in].
fn rank_of(a: &Tensor, n: usize) -> Result<usize> {
    let rows = a.dim(0)?;
    if n == 0 || rows % n != 0 {
        candle_core::bail!("fold_drop: {rows} stacked A rows for {n} linears");
    }
    Ok(rows / n)
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::ops::cuda::{addr, addr_rows, function, uninit};
    use crate::ops::dropout::{DropKey, Dropout};
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{DType, Device, Result, Tensor};

    /// fold_drop.cu's DropXasP.
    #[repr(C)]
    struct DropXasP {
        x: u64,
        a: u64,
        part: u64,
        ldx: i64,
        m: i32,
        in_f: i32,
        r: i32,
        nr: i32,
        kc: i32,
        d: [DropKey; 3],
    }
    // SAFETY: plain old data laid out as the C struct the kernel takes by value.
    unsafe impl DeviceRepr for DropXasP {}

    /// fold_drop.cu's DropBwdP.
    #[repr(C)]
    struct DropBwdP {
        x: u64,
        dx: u64,
        gb: u64,
        a: u64,
        part: u64,
        ldx: i64,
        ldd: i64,
        ldg: i64,
        m: i32,
        in_f: i32,
        r: i32,
        n: i32,
        s: f32,
        d: [DropKey; 3],
    }
    // SAFETY: as DropXasP.
    unsafe impl DeviceRepr for DropBwdP {}

    /// The kernels' keys of `drops` (at most 3), the rest unused.
    fn keys(drops: &[Dropout]) -> Option<[DropKey; 3]> {
        let mut k = [DropKey::of(None); 3];
        if drops.is_empty() || drops.len() > 3 {
            return None;
        }
        for (k, d) in k.iter_mut().zip(drops) {
            *k = DropKey::of(Some(d));
        }
        Some(k)
    }

    /// What both kernels take of x and the stacked A's.
    struct Operands {
        m: usize,
        in_f: usize,
        r: usize,
        x: u64,
        ldx: usize,
        a: u64,
    }

    /// The shapes both kernels take: bf16 x [m, in] (rows contiguous, an even row stride),
    /// a [n·r, in] contiguous, r a multiple of 8 up to 64, in a multiple of 8.
    fn operands(x: &Tensor, a: &Tensor, n: usize) -> Result<Option<Operands>> {
        let (Ok((m, in_f)), Ok((nr, ain))) = (x.dims2(), a.dims2()) else {
            return Ok(None);
        };
        if x.dtype() != DType::BF16 || a.dtype() != DType::BF16 || n == 0 || nr % n != 0 {
            return Ok(None);
        }
        let r = nr / n;
        if ain != in_f || in_f % 8 != 0 || r % 8 != 0 || !(8..=64).contains(&r) || m == 0 {
            return Ok(None);
        }
        let (Some((xp, ldx)), Some(ap)) = (addr_rows(x)?, addr(a)?) else {
            return Ok(None);
        };
        if xp % 4 != 0 || ap % 4 != 0 || ldx % 2 != 0 {
            return Ok(None);
        }
        Ok(Some(Operands {
            m,
            in_f,
            r,
            x: xp,
            ldx,
            a: ap,
        }))
    }

    /// Blocks a grid is given at least, by cutting x's columns into chunks (drop_xas).
    const XAS_BLOCKS: usize = 1024;

    pub(crate) fn xas(
        x: &Tensor,
        a: &Tensor,
        drops: &[Dropout],
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (Some(d), Some(op)) = (keys(drops), operands(x, a, drops.len())?) else {
            return Ok(None);
        };
        let (m, in_f, r, xp, ldx, ap) = (op.m, op.in_f, op.r, op.x, op.ldx, op.a);
        let (n, nr) = (drops.len(), drops.len() * r);
        let tiles = m.div_ceil(64);
        // Column chunks of a whole number of k steps, enough of them to fill the device.
        let want = XAS_BLOCKS.div_ceil(n * tiles).clamp(1, in_f.div_ceil(128));
        let kc = in_f.div_ceil(want).next_multiple_of(16);
        let chunks = in_f.div_ceil(kc);
        let ints = [m, in_f, r, nr, kc].map(i32::try_from);
        let [Ok(mi), Ok(ii), Ok(ri), Ok(nri), Ok(kci)] = ints else {
            return Ok(None);
        };
        if tiles > 65535 {
            return Ok(None);
        }
        // SAFETY: drop_xas writes every (chunk, token, rank) of part (each chunk starts below
        // in; tokens below m; ranks below r of each linear); drop_xas_sum every element of y.
        let (Some(part), Some(y)) = (unsafe {
            (
                uninit(dev, DType::F32, (chunks, m, nr))?,
                uninit(dev, DType::BF16, (m, nr))?,
            )
        }) else {
            return Ok(None);
        };
        let (Some(pp), Some(yp)) = (addr(&part)?, addr(&y)?) else {
            return Ok(None);
        };
        let p = DropXasP {
            x: xp,
            a: ap,
            part: pp,
            ldx: ldx as i64,
            m: mi,
            in_f: ii,
            r: ri,
            nr: nri,
            kc: kci,
            d,
        };
        let name = match r {
            ..=8 => "drop_xas_n1",
            9..=16 => "drop_xas_n2",
            17..=32 => "drop_xas_n4",
            _ => "drop_xas_n8",
        };
        let stream = dev.cuda_stream();
        let func = function(dev, name)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, chunks as u32, tiles as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&p);
        // SAFETY: x [m, in] rows ldx apart, a [n·r, in] and part [chunks, m, n·r] are live
        // buffers of the sizes checked above, on this stream.
        unsafe { b.launch(cfg) }.w()?;
        let sum = function(dev, "drop_xas_sum")?;
        let (ci, ldo, s) = (chunks as i32, nr as i64, scale as f32);
        let mut b = stream.launch_builder(&sum);
        b.arg(&pp)
            .arg(&yp)
            .arg(&ci)
            .arg(&mi)
            .arg(&nri)
            .arg(&ldo)
            .arg(&s);
        // SAFETY: part holds `chunks` slices of m·nr f32, y m·nr bf16; both ours.
        unsafe { b.launch(crate::ops::cuda::elems(m * nr)?) }.w()?;
        drop(part);
        Ok(Some(y))
    }

    /// Tokens a block of drop_bwd: the partial dA's are ⌈m / 256⌉ [n·r, in] slices.
    const TOKENS: usize = 256;

    pub(crate) fn bwd(
        x: &Tensor,
        dx: &Tensor,
        gb: &Tensor,
        a: &Tensor,
        drops: &[Dropout],
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (Some(d), Some(op)) = (keys(drops), operands(x, a, drops.len())?) else {
            return Ok(None);
        };
        let (m, in_f, r, xp, ldx, ap) = (op.m, op.in_f, op.r, op.x, op.ldx, op.a);
        let (n, nr) = (drops.len(), drops.len() * r);
        let fits = dx.dims() == x.dims() && gb.dims() == [m, nr];
        if !fits || dx.dtype() != DType::BF16 || gb.dtype() != DType::BF16 {
            return Ok(None);
        }
        let (Some((dp, ldd)), Some((gp, ldg))) = (addr_rows(dx)?, addr_rows(gb)?) else {
            return Ok(None);
        };
        if dp % 4 != 0 || gp % 4 != 0 || ldd % 2 != 0 || ldg % 2 != 0 {
            return Ok(None);
        }
        let ints = [m, in_f, r, n].map(i32::try_from);
        let [Ok(mi), Ok(ii), Ok(ri), Ok(ni)] = ints else {
            return Ok(None);
        };
        let parts = m.div_ceil(TOKENS);
        // SAFETY: each block writes its [n·r, in] slice of part for the columns of its 64
        // (every column, in being a multiple of 8), each linear's r ranks; the sum every dA.
        let (Some(part), Some(da)) = (unsafe {
            (
                uninit(dev, DType::F32, (parts, nr, in_f))?,
                uninit(dev, DType::F32, (nr, in_f))?,
            )
        }) else {
            return Ok(None);
        };
        let (Some(pp), Some(dap)) = (addr(&part)?, addr(&da)?) else {
            return Ok(None);
        };
        let p = DropBwdP {
            x: xp,
            dx: dp,
            gb: gp,
            a: ap,
            part: pp,
            ldx: ldx as i64,
            ldd: ldd as i64,
            ldg: ldg as i64,
            m: mi,
            in_f: ii,
            r: ri,
            n: ni,
            s: scale as f32,
            d,
        };
        let name = match r {
            ..=16 => "drop_bwd_r16",
            17..=32 => "drop_bwd_r32",
            _ => "drop_bwd_r64",
        };
        let stream = dev.cuda_stream();
        let func = function(dev, name)?;
        let cfg = LaunchConfig {
            grid_dim: (in_f.div_ceil(64) as u32, parts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&p);
        // SAFETY: x and dx [m, in] (rows ldx, ldd apart), gb [m, n·r] (rows ldg apart), a and
        // part live buffers of the sizes checked above, on this stream; dx is the caller's
        // fresh result, written in place (its columns apart from gb's when both are slices of
        // one buffer: gb's are past in).
        unsafe { b.launch(cfg) }.w()?;
        let sum = function(dev, "sum_parts_f32")?;
        let (pi, nn) = (parts as i32, (nr * in_f) as i64);
        let mut b = stream.launch_builder(&sum);
        b.arg(&pp).arg(&dap).arg(&pi).arg(&nn);
        // SAFETY: part holds `parts` slices of nn f32, da nn; both ours, on this stream.
        unsafe { b.launch(crate::ops::cuda::elems(nn as usize)?) }.w()?;
        drop(part);
        Ok(Some(da))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::dropout::mask_tensor;
    use candle_core::{Device, Var};

    /// Three linears sharing x, each its own mask: the group's xas and backward terms against
    /// autograd through plain tensor ops with the masks as tensors.
    #[test]
    fn group_products_equal_autograd_with_the_masks_as_tensors() {
        let dev = Device::Cpu;
        let (m, in_f, r, s) = (37, 24, 4, 0.5);
        let drops: Vec<Dropout> = (0..3)
            .map(|j| Dropout::new(0.3, 9, [2, 1], [4, j]).unwrap())
            .collect();
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (m, in_f), &dev).unwrap()).unwrap();
        let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3 * r, in_f), &dev).unwrap()).unwrap();
        let gb = Tensor::randn(0f32, 1.0, (m, 3 * r), &dev).unwrap();
        let dx0 = Tensor::randn(0f32, 1.0, (m, in_f), &dev).unwrap();
        let gemm = Gemm::Heuristic;

        let got = xas(x.as_tensor(), a.as_tensor(), &drops, s, gemm).unwrap();
        let (dx, da) = bwd(
            x.as_tensor(),
            dx0.clone(),
            &gb,
            a.as_tensor(),
            &drops,
            s,
            gemm,
        )
        .unwrap();

        // L = Σ_j Σ xas_j ⊙ gB_j: dL/dx = Σ_j s (gB_j A_j) ⊙ m_j, dL/dA_j = s gB_jᵀ (m_j ⊙ x)
        let mut want = Vec::new();
        let mut loss = Tensor::zeros((), candle_core::DType::F32, &dev).unwrap();
        for (j, d) in drops.iter().enumerate() {
            let mask = mask_tensor(&[m, in_f], d, &dev).unwrap();
            let aj = a.as_tensor().narrow(0, j * r, r).unwrap();
            let xd = (x.as_tensor() * &mask).unwrap();
            let y = (xd.matmul(&aj.t().unwrap()).unwrap() * s).unwrap(); // [m, r]
            let gj = gb.narrow(1, j * r, r).unwrap();
            loss = (loss + (&y * &gj).unwrap().sum_all().unwrap()).unwrap();
            want.push(y);
        }
        let want = Tensor::cat(&want, 1).unwrap();
        let diff = |p: &Tensor, q: &Tensor| {
            (p - q)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(diff(&got, &want) < 1e-5, "xas: {}", diff(&got, &want));
        let grads = loss.backward().unwrap();
        let dx_want = (grads.get(x.as_tensor()).unwrap() + &dx0).unwrap();
        assert!(diff(&dx, &dx_want) < 1e-5, "dx: {}", diff(&dx, &dx_want));
        let da_want = grads.get(a.as_tensor()).unwrap();
        assert!(diff(&da, da_want) < 1e-5, "dA: {}", diff(&da, da_want));
        // The masks matter: with one linear's mask swapped for another's, xas changes.
        let other = [drops[1], drops[0], drops[2]];
        let swapped = xas(x.as_tensor(), a.as_tensor(), &other, s, gemm).unwrap();
        assert!(diff(&swapped, &want) > 1e-2);
    }
}
