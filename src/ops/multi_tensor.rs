//! Many f32 tensors in one launch (`multi_tensor.cu`): the AdamW update and the gradients'
//! Σ g². A LoRA model has hundreds of small adapters; as tensor ops the optimiser's step is a
//! dozen launches per tensor plus the copies into flat groups, and the GPU, done with the
//! backward, would wait on the host for every one of them. CUDA only: `train::optim` runs the
//! tensor-op version elsewhere, and whenever a tensor is not a contiguous f32 CUDA buffer.

use candle_core::{DType, Device, Result, Tensor};

/// One tensor of a launch: device addresses of its data p, gradient g and moments m, v (any
/// may be 0 where the kernel does not read it), and its length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MultiT {
    pub(crate) p: u64,
    pub(crate) g: u64,
    pub(crate) m: u64,
    pub(crate) v: u64,
    pub(crate) n: i64,
}

/// The AdamW step's f32 factors, each rounded from f64 as the tensor ops round theirs.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct AdamScalars {
    /// Gradient factor (clipping); 1 leaves the gradient as it is.
    pub(crate) coef: f32,
    /// 1 − lr·wd.
    pub(crate) decay: f32,
    pub(crate) b1: f32,
    /// 1 − β1.
    pub(crate) nb1: f32,
    pub(crate) b2: f32,
    /// 1 − β2.
    pub(crate) nb2: f32,
    /// 1 / √(1 − β2ᵗ).
    pub(crate) inv_bc2: f32,
    pub(crate) eps: f32,
    /// lr / (1 − β1ᵗ).
    pub(crate) step: f32,
}

/// The device address of contiguous f32 `t`'s first element; None when `t` is anything else
/// (another dtype or device, a strided view).
pub(crate) fn f32_addr(t: &Tensor) -> Result<Option<u64>> {
    if t.dtype() != DType::F32 || !matches!(t.device(), Device::Cuda(_)) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        super::cuda::addr(t)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::{adamw, adamw_clip, cast_bf16, cast_rows_bf16, clip_step, sumsq};

#[cfg(feature = "cuda")]
mod imp {
    use super::{AdamScalars, MultiT};
    use candle_core::cuda::cudarc::driver::{
        CudaSlice, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, Result};

    // SAFETY: plain old data laid out as the C struct the kernels read.
    unsafe impl DeviceRepr for MultiT {}

    const THREADS: u32 = 256;
    /// The grid's y side (one tensor a row of blocks) holds at most this many.
    const MAX_Y: usize = 65535;

    /// Blocks per tensor: enough that the largest has ~16 elements a thread, at most 64.
    fn blocks_x(ts: &[MultiT]) -> u32 {
        let most = ts.iter().map(|t| t.n.max(0) as usize).max().unwrap_or(0);
        most.div_ceil(THREADS as usize * 16).clamp(1, 64) as u32
    }

    /// The launches over `ts`: parts of at most MAX_Y tensors (block (x, y) on tensor y of the
    /// part), each with its table on the device, its grid, and its number of tensors.
    fn parts(
        dev: &CudaDevice,
        ts: &[MultiT],
    ) -> Result<Vec<(CudaSlice<MultiT>, LaunchConfig, usize)>> {
        let gx = blocks_x(ts);
        ts.chunks(MAX_Y)
            .map(|part| {
                let cfg = LaunchConfig {
                    grid_dim: (gx, part.len() as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                Ok((dev.cuda_stream().clone_htod(part).w()?, cfg, part.len()))
            })
            .collect()
    }

    /// The AdamW kernels' arguments after their table and gradient factor (`s.coef` or the
    /// device clip), in their order.
    fn step_args<'a>(b: &mut LaunchArgs<'a>, s: &'a AdamScalars) {
        b.arg(&s.decay)
            .arg(&s.b1)
            .arg(&s.nb1)
            .arg(&s.b2)
            .arg(&s.nb2)
            .arg(&s.inv_bc2)
            .arg(&s.eps)
            .arg(&s.step);
    }

    /// Updates every tensor of `ts` (p, m, v in place, from g) by one AdamW step.
    pub(crate) fn adamw(dev: &CudaDevice, ts: &[MultiT], s: &AdamScalars) -> Result<()> {
        let func = crate::ops::cuda::function(dev, "adamw_multi")?;
        let stream = dev.cuda_stream();
        for (table, cfg, _) in parts(dev, ts)? {
            let mut b = stream.launch_builder(&func);
            b.arg(&table).arg(&s.coef);
            step_args(&mut b, s);
            // SAFETY: every address of the table is a live f32 buffer of at least n elements
            // (the caller's tensors, which outlive the launch in stream order).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }

    /// bf16 copies of f32 tensors, in one buffer: `ts` gives each source (g) and length, the
    /// copies lie one after the other in the returned buffer, in `ts` order.
    pub(crate) fn cast_bf16(dev: &CudaDevice, ts: &[MultiT]) -> Result<CudaSlice<half::bf16>> {
        let func = crate::ops::cuda::function(dev, "cast_multi_bf16")?;
        let stream = dev.cuda_stream();
        let total: usize = ts.iter().map(|t| t.n.max(0) as usize).sum();
        // SAFETY: every element is written: the copies tile the buffer.
        let out = unsafe { stream.alloc::<half::bf16>(total.max(1)) }.w()?;
        let base = out.device_ptr(&stream).0;
        let mut off = 0u64;
        let table: Vec<MultiT> = ts
            .iter()
            .map(|t| {
                let p = base + 2 * off;
                off += t.n.max(0) as u64;
                MultiT { p, ..*t }
            })
            .collect();
        for (table, cfg, _) in parts(dev, &table)? {
            let mut b = stream.launch_builder(&func);
            b.arg(&table);
            // SAFETY: sources are live f32 buffers of n elements; destinations are disjoint
            // ranges of `out`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }

    /// Each of `ts`'s f32 tensors (its g, `n` elements in rows of `m` as stored) rounded to
    /// bf16 into rows `v` elements apart from its `p`, in one launch (`ops::fold`'s B columns).
    ///
    /// # Safety
    /// Each p must be a live bf16 buffer on this device's stream holding n / m rows of v
    /// elements (v ≥ m), and no two tables' destinations may overlap.
    pub(crate) unsafe fn cast_rows_bf16(dev: &CudaDevice, ts: &[MultiT]) -> Result<()> {
        let func = crate::ops::cuda::function(dev, "cast_rows_multi_bf16")?;
        let stream = dev.cuda_stream();
        for (table, cfg, _) in parts(dev, ts)? {
            let mut b = stream.launch_builder(&func);
            b.arg(&table);
            // SAFETY: the caller's contract (above); sources are live f32 buffers of n elements.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }

    /// `adamw` with the clipping read from the device: `clip` is `clip_step`'s [‖g‖, coef,
    /// skip] (`s.coef` is not used); skip ≠ 0 leaves every tensor as it is.
    pub(crate) fn adamw_clip(
        dev: &CudaDevice,
        ts: &[MultiT],
        s: &AdamScalars,
        clip: &CudaSlice<f32>,
    ) -> Result<()> {
        let func = crate::ops::cuda::function(dev, "adamw_multi_clip")?;
        let stream = dev.cuda_stream();
        for (table, cfg, _) in parts(dev, ts)? {
            let mut b = stream.launch_builder(&func);
            b.arg(&table).arg(clip);
            step_args(&mut b, s);
            // SAFETY: as in `adamw`; `clip` holds 3 f32 written before on this stream.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }

    /// The step's clipping on the device, no host round trip: Σ g² over every tensor of `ts`
    /// (their g) as `sumsq` sums it, then [‖g‖, coef, skip] f32 (the `clip_step` kernel):
    /// coef = min(1, max_norm / (‖g‖ + 1e-6)) (1 when max_norm ≤ 0); skip = 1 when ‖g‖ or
    /// the f32 at `ce` (0: none) is not finite.
    pub(crate) fn clip_step(
        dev: &CudaDevice,
        ts: &[MultiT],
        ce: u64,
        max_norm: f64,
    ) -> Result<CudaSlice<f32>> {
        let sumsq = crate::ops::cuda::function(dev, "sumsq_multi")?;
        let clip = crate::ops::cuda::function(dev, "clip_step")?;
        let stream = dev.cuda_stream();
        let launches = parts(dev, ts)?;
        let total: usize = launches
            .iter()
            .map(|(_, cfg, n)| cfg.grid_dim.0 as usize * n)
            .sum();
        // SAFETY: every element is written by the launches below (one per block).
        let mut part = unsafe { stream.alloc::<f32>(total.max(1)) }.w()?;
        let mut off = 0;
        for (table, cfg, n) in launches {
            let k = cfg.grid_dim.0 as usize * n;
            let mut view = part.slice_mut(off..off + k);
            let mut b = stream.launch_builder(&sumsq);
            b.arg(&table).arg(&mut view);
            // SAFETY: as in `adamw`; the view holds one f32 per block.
            unsafe { b.launch(cfg) }.w()?;
            off += k;
        }
        // SAFETY: the kernel writes all three.
        let out = unsafe { stream.alloc::<f32>(3) }.w()?;
        let n = total as i64;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&clip);
        b.arg(&part).arg(&n).arg(&ce).arg(&max_norm).arg(&out);
        // SAFETY: `part` holds n f32; `ce` is 0 or a live f32 on this device; `out` holds 3.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }

    /// Σ g² over every tensor of `ts` (their g), summed in f64 in a fixed order.
    pub(crate) fn sumsq(dev: &CudaDevice, ts: &[MultiT]) -> Result<f64> {
        let func = crate::ops::cuda::function(dev, "sumsq_multi")?;
        let stream = dev.cuda_stream();
        let mut total = 0.0;
        for (table, cfg, n) in parts(dev, ts)? {
            // SAFETY: every element is written by the kernel (one per block).
            let out = unsafe { stream.alloc::<f32>(cfg.grid_dim.0 as usize * n) }.w()?;
            let mut b = stream.launch_builder(&func);
            b.arg(&table).arg(&out);
            // SAFETY: as in `adamw`; `out` holds one f32 per block.
            unsafe { b.launch(cfg) }.w()?;
            total += stream
                .clone_dtoh(&out)
                .w()?
                .iter()
                .map(|&x| x as f64)
                .sum::<f64>();
        }
        Ok(total)
    }
}
