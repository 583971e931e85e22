//! A MoE layer's rows between its tokens [m, C] and the rows grouped by expert [P, C]
//! (`model::router::Routing`): the gather of the tokens' rows, the weighted sum of each
//! token's k expert outputs, and the backward's gather of dL/dy with the routing weights'
//! gradient. As candle ops each is an index_select and elementwise passes over [P, C] (a
//! broadcast multiply, k − 1 adds, a product and a row sum), each pass at a fraction of memory
//! speed; on CUDA in bf16 (moe_rows.cu) each is one pass, 16 bytes a thread, f32 sums rounded
//! once. Elsewhere, f32 on CUDA included, and where an input records autograd's graph (the
//! reference forward), they are those candle ops.
//!
//! Shapes: m tokens, k slots a token, P = m·k grouped rows, C columns.

use candle_core::{DType, Result, Tensor};

/// src[idx]: src [m, C], idx [P] u32 → [P, C].
pub fn gather(src: &Tensor, idx: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if !src.track_op() {
        if let Some(out) = cuda::gather(src, idx)? {
            return Ok(out);
        }
    }
    src.index_select(idx, 0)
}

/// Token n's k grouped rows summed, each scaled by its weight: Σ_j w[q] · y[q], q = slots[j·m +
/// n] (`Routing::slots`); y [P, C], slots [k·m] u32, w [P] f32 (None: all 1) → [m, C].
pub fn combine(y: &Tensor, slots: &Tensor, w: Option<&Tensor>, k: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if !y.track_op() && !w.is_some_and(|w| w.track_op()) {
        if let Some(out) = cuda::combine(y, slots, w, k)? {
            return Ok(out);
        }
    }
    let m = slots.dim(0)? / k.max(1);
    let y = match w {
        Some(w) => y.broadcast_mul(&w.to_dtype(y.dtype())?.unsqueeze(1)?)?,
        None => y.clone(),
    };
    let g = y.index_select(slots, 0)?; // [k·m, C]
    let mut acc = g.narrow(0, 0, m)?;
    for j in 1..k {
        acc = (acc + g.narrow(0, j * m, m)?)?;
    }
    Ok(acc)
}

/// The backward's gather: for grouped row q of token tok[q], gy[q] = w[q] · g[tok[q]] and
/// dw[q] = Σ_c g[tok[q], c] · y[q, c]; g [m, C], tok [P] u32, w [P] f32, y [P, C] → (gy [P, C],
/// dw [P] f32). No graph.
pub fn scatter_grad(g: &Tensor, tok: &Tensor, w: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(out) = cuda::scatter_grad(g, tok, w, y)? {
        return Ok(out);
    }
    let gs = g.contiguous()?.index_select(tok, 0)?; // [P, C]
    let dw = (&gs * y)?.sum(1)?.to_dtype(DType::F32)?;
    let gy = gs.broadcast_mul(&w.to_dtype(g.dtype())?.unsqueeze(1)?)?;
    Ok((gy, dw))
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The launchers of moe_rows.cu: bf16 rows of a multiple of 8 columns, contiguous.
    use crate::ops::cuda::{addr, function, uninit};
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, DType, Device, Result, Tensor};

    /// The device, columns and addresses when every tensor is on one CUDA device, contiguous
    /// and 16-byte aligned, the rows bf16 of C columns (C a multiple of 8), the indices u32
    /// and the weights f32; None otherwise.
    fn operands<const N: usize>(
        rows: &[&Tensor],
        others: [(&Tensor, DType); N],
    ) -> Result<Option<(CudaDevice, i32, Vec<u64>)>> {
        let Some(first) = rows.first() else {
            return Ok(None);
        };
        let (Device::Cuda(dev), Ok((_, cols))) = (first.device(), first.dims2()) else {
            return Ok(None);
        };
        let mut ptrs = Vec::new();
        for t in rows {
            if t.dtype() != DType::BF16 || !matches!(t.dims2(), Ok((_, c)) if c == cols) {
                return Ok(None);
            }
        }
        let all = rows.iter().map(|t| (*t, DType::BF16)).chain(others);
        for (t, dt) in all {
            if t.dtype() != dt || !t.device().same_device(first.device()) {
                return Ok(None);
            }
            match addr(t)? {
                Some(p) if p % 16 == 0 => ptrs.push(p),
                _ => return Ok(None),
            }
        }
        match (cols % 8, i32::try_from(cols)) {
            (0, Ok(c)) if c > 0 => Ok(Some((dev.clone(), c, ptrs))),
            _ => Ok(None),
        }
    }

    /// A fresh contiguous tensor and its address.
    ///
    /// # Safety
    /// Every element must be written (by the caller's kernel) before any is read.
    unsafe fn fresh(
        dev: &CudaDevice,
        dt: DType,
        shape: impl Into<candle_core::Shape>,
    ) -> Result<Option<(Tensor, u64)>> {
        let Some(t) = uninit(dev, dt, shape)? else {
            return Ok(None);
        };
        Ok(addr(&t)?.map(|p| (t, p)))
    }

    /// One block per output row, a thread per 16 bytes of it (up to 256).
    fn per_row(rows: usize, cols: i32) -> Result<LaunchConfig> {
        let Ok(rows) = u32::try_from(rows) else {
            candle_core::bail!("moe rows: {rows} rows exceed one launch");
        };
        let threads = ((cols as u32 / 8).div_ceil(32) * 32).clamp(32, 256);
        Ok(LaunchConfig {
            grid_dim: (rows.max(1), 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    pub(crate) fn gather(src: &Tensor, idx: &Tensor) -> Result<Option<Tensor>> {
        let Some((dev, cols, p)) = operands(&[src], [(idx, DType::U32)])? else {
            return Ok(None);
        };
        let rows = idx.dim(0)?;
        // SAFETY: the kernel writes every row whole.
        let Some((out, op)) = (unsafe { fresh(&dev, DType::BF16, (rows, src.dim(1)?))? }) else {
            return Ok(None);
        };
        let func = function(&dev, "moe_gather_bf16")?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&p[0]).arg(&p[1]).arg(&op).arg(&cols);
        if rows > 0 {
            // SAFETY: src holds every indexed row (the routing's tokens are < m), out has `rows`.
            unsafe { b.launch(per_row(rows, cols)?) }.w()?;
        }
        Ok(Some(out))
    }

    pub(crate) fn combine(
        y: &Tensor,
        slots: &Tensor,
        w: Option<&Tensor>,
        k: usize,
    ) -> Result<Option<Tensor>> {
        let ops = match w {
            Some(w) => operands(&[y], [(slots, DType::U32), (w, DType::F32)])?,
            None => operands(&[y], [(slots, DType::U32)])?,
        };
        let (Some((dev, cols, p)), Ok(ki)) = (ops, i32::try_from(k)) else {
            return Ok(None);
        };
        let m = slots.dim(0)? / k.max(1);
        let (Ok(mi), true) = (i32::try_from(m), m * k == slots.dim(0)?) else {
            return Ok(None);
        };
        // SAFETY: the kernel writes every row whole.
        let Some((out, op)) = (unsafe { fresh(&dev, DType::BF16, (m, y.dim(1)?))? }) else {
            return Ok(None);
        };
        let wp = p.get(2).copied().unwrap_or(0); // null: weights of 1
        let func = function(&dev, "moe_combine_bf16")?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&p[0])
            .arg(&p[1])
            .arg(&wp)
            .arg(&op)
            .arg(&mi)
            .arg(&ki)
            .arg(&cols);
        if m > 0 {
            // SAFETY: slots index rows of y (a permutation of its P rows), out has m rows.
            unsafe { b.launch(per_row(m, cols)?) }.w()?;
        }
        Ok(Some(out))
    }

    pub(crate) fn scatter_grad(
        g: &Tensor,
        tok: &Tensor,
        w: &Tensor,
        y: &Tensor,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let ops = operands(&[g, y], [(tok, DType::U32), (w, DType::F32)])?;
        let Some((dev, cols, p)) = ops else {
            return Ok(None);
        };
        let rows = y.dim(0)?;
        if tok.dim(0)? != rows || w.dim(0)? != rows {
            return Ok(None);
        }
        // SAFETY: the kernel writes every row of gy whole and every dw.
        let (Some((gy, gyp)), Some((dw, dwp))) = (unsafe {
            (
                fresh(&dev, DType::BF16, (rows, y.dim(1)?))?,
                fresh(&dev, DType::F32, rows)?,
            )
        }) else {
            return Ok(None);
        };
        let func = function(&dev, "moe_scatter_grad_bf16")?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        // g, y, tok, w as `operands` ordered them
        b.arg(&p[0])
            .arg(&p[2])
            .arg(&p[3])
            .arg(&p[1])
            .arg(&gyp)
            .arg(&dwp)
            .arg(&cols);
        if rows > 0 {
            // SAFETY: tok indexes rows of g (tokens < m), gy and dw have y's rows.
            unsafe { b.launch(per_row(rows, cols)?) }.w()?;
        }
        Ok(Some((gy, dw)))
    }
}
