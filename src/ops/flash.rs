//! Causal attention on tensor cores: the kernels of `flash.cu` (CUDA, bf16, head dim 64, 96, 128
//! or 256, Gemma 2's soft-capped scores) and `flash90.cu` (head dim 128, no cap; head dim 256,
//! capped or not).
//!
//! Same contract as `attention::attention_fwd` / `attention_bwd` (causal, optional segments or
//! prefix trees, sliding window and soft-cap, L = log-sum-exp in natural log), but one kernel
//! per pass instead of cuBLAS GEMMs per query block plus three elementwise kernels over the
//! [bq × T] score blocks, and GQA without repeating k and v. The blockwise path stays the
//! reference (its tests pin it to the composite) and the fallback: CPU, f32 and f16, other head
//! dims (`ops::kernels::Attention`).
//!
//! Inputs are [B, H, T, D] views: d contiguous, the other strides and the start multiples of 8
//! elements, and laid out without gaps, so that heads-major tensors and token-major rows
//! [B·T, H·D] (viewed as `reshape((b, t, h, d)).transpose(1, 2)`) both go in without a copy.

use super::kernels::Attention;
use super::AttnMask;
use candle_core::{Result, Tensor};

/// q [B, H, T, D], k, v [B, K, T, D] → (O as token-major rows [B·T, H·D], L [B, H, T] f32), on
/// the tensor-core kernels `kernels` names (`Kernels::attention`; `Blockwise` is an error);
/// with `mask.sinks`, (O', L') as `attention::apply_sinks` makes them.
pub fn flash_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    scale: f64,
    kernels: Attention,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        let (o, lse) = imp::fwd(q, k, v, mask, scale, kernels)?;
        // gpt-oss's sinks: (O', L') from the plain pass's, which the backward takes as they are
        match &mask.sinks {
            Some(s) => super::attention::apply_sinks_rows(&o, &lse, s),
            None => Ok((o, lse)),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, k, v, mask, scale, kernels);
        candle_core::bail!("flash attention needs the cuda feature")
    }
}

/// Given dO [B, H, T, D], δ = rowsum(dO ⊙ O) and L [B, H, T] f32: (dq, dk, dv), each laid out
/// like its input (dk and dv summed over the query heads of each kv head). With `rope` =
/// (cos, sin) [B, T, D/2] f32, q and k having been rotated by RoPE, dq and dk come back
/// rotated back (dL/d of the unrotated q and k) and laid out as token-major rows (viewed
/// [B, H, T, D]): RoPE's backward and the layout change happen in the kernels' stores.
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    delta: &Tensor,
    lse: &Tensor,
    mask: &AttnMask,
    scale: f64,
    rope: Option<(&Tensor, &Tensor)>,
    kernels: Attention,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        imp::bwd(q, k, v, d_o, delta, lse, mask, scale, rope, kernels)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, k, v, d_o, delta, lse, mask, scale, rope, kernels);
        candle_core::bail!("flash attention needs the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{Attention, AttnMask};
    use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute_enum;
    use candle_core::cuda::cudarc::driver::{
        CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

    /// `FlashP` of flash.cu, field for field.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct FlashP {
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        dq: u64,
        dk: u64,
        dv: u64,
        lse: u64,
        delta: u64,
        seg: u64,
        rc: u64,
        rs: u64,
        dqacc: u64,
        sq: [i64; 3],
        sk: [i64; 3],
        sv: [i64; 3],
        so: [i64; 3],
        sdq: [i64; 3],
        sdk: [i64; 3],
        b: i32,
        h: i32,
        kh: i32,
        t: i32,
        window: i32,
        scale: f32,
        softcap: f32,
        tree: i32,
    }
    // SAFETY: plain old data laid out as the C struct the kernels take by value.
    unsafe impl DeviceRepr for FlashP {}

    // A block: flash.cu's are 4 warps, flash90.cu's two warpgroups.
    const THREADS: u32 = 128;
    const THREADS90: u32 = 256;
    /// Bytes of a 128-row bf16 tile of head dim 128 in shared memory (swizzled, unpadded).
    const TILE128: u32 = 128 * 128 * 2;

    /// The wgmma kernels take head dim 128 and no soft-cap (a cap would be silently dropped).
    fn wgmma_d(d: usize, p: &FlashP) -> Result<()> {
        if d != 128 {
            candle_core::bail!("flash attention: the wgmma kernels take head dim 128, not {d}");
        }
        if p.softcap != 0.0 {
            candle_core::bail!("flash attention: the wgmma kernels do not soft-cap (use MmaSync)");
        }
        Ok(())
    }

    /// flash90.cu's d256 kernels take head dim 256 (and soft-caps).
    fn wgmma256_d(d: usize) -> Result<()> {
        if d != 256 {
            candle_core::bail!(
                "flash attention: the d256 wgmma kernels take head dim 256, not {d}"
            );
        }
        Ok(())
    }

    /// flash.cu's `FlCfg<D>`: the mma.sync kernels' tiles at head dim `d`.
    struct MmaCfg {
        /// Q (and dO) stay in registers; else each has its own [64][D + 8] shared tile.
        rows_in_regs: bool,
        /// flash_fwd's and flash_dq's key tiles (rows).
        fwd_bk: usize,
        dq_bk: usize,
        /// flash_dkdv's threads: 256 where warps pair up over the keys (flash.cu, D > 128).
        dkdv_threads: u32,
    }

    fn mma_cfg(d: usize) -> MmaCfg {
        let small = d <= 128;
        MmaCfg {
            rows_in_regs: small,
            fwd_bk: if small { 64 } else { 32 },
            dq_bk: if small { 32 } else { 16 },
            dkdv_threads: if small { THREADS } else { 2 * THREADS },
        }
    }

    /// flash90.cu's `Tmaps`: tensor maps of q, k and v, and each one's slots of t, h and b.
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Tmaps {
        q: [u64; 16],
        k: [u64; 16],
        v: [u64; 16],
        ord: [[i32; 3]; 3],
    }
    // SAFETY: plain old data laid out as the C struct the kernel takes by value.
    unsafe impl DeviceRepr for Tmaps {}

    /// The copy engine's map of a bf16 [B, H, T, 128] view at `addr` with (b, h, t) strides
    /// `st` (elements): dims d, then the other three innermost first, boxes of 64 columns ×
    /// 128 rows × 1 × 1 in the 128-byte swizzle, rows past T read as zeros. Returned with the
    /// slots of t, h and b among the three (`Tmaps::ord`).
    fn tmap(addr: u64, dims: [usize; 3], st: [i64; 3]) -> Result<([u64; 16], [i32; 3])> {
        use candle_core::cuda::cudarc::driver::sys;
        let mut by = [2usize, 1, 0]; // t, h, b: the innermost first after sorting
        by.sort_by_key(|&i| st[i]);
        let slot = |i: usize| by.iter().position(|&x| x == i).unwrap_or(0) as i32;
        let ord = [slot(2), slot(1), slot(0)];
        let gdim: [u64; 4] = [
            128,
            dims[by[0]] as u64,
            dims[by[1]] as u64,
            dims[by[2]] as u64,
        ];
        let gstride: [u64; 3] = [
            st[by[0]] as u64 * 2,
            st[by[1]] as u64 * 2,
            st[by[2]] as u64 * 2,
        ];
        let rows = |i: usize| if i == 2 { 128u32 } else { 1 };
        let boxd: [u32; 4] = [64, rows(by[0]), rows(by[1]), rows(by[2])];
        let elem: [u32; 4] = [1; 4];
        let mut m = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every array has the rank the call is given; the address is a live device
        // buffer covering the dims and strides given.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                m.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                4,
                addr as *mut std::ffi::c_void,
                gdim.as_ptr(),
                gstride.as_ptr(),
                boxd.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!(
                "flash attention: cuTensorMapEncodeTiled failed ({r:?}) for dims {dims:?}, strides {st:?}"
            );
        }
        // SAFETY: written by the successful call above.
        Ok((unsafe { m.assume_init() }.opaque, ord))
    }

    /// The device address of the first element `l` describes.
    fn addr<T: CudaDType + DeviceRepr>(
        s: &Storage,
        l: &Layout,
        stream: &CudaStream,
    ) -> Result<u64> {
        let Storage::Cuda(cs) = s else {
            candle_core::bail!("flash attention: an input is not on the GPU")
        };
        let (p, _sync) = cs.as_cuda_slice::<T>()?.device_ptr(stream);
        Ok(p + (l.start_offset() * std::mem::size_of::<T>()) as u64)
    }

    /// (b, h, t) strides of a [B, H, T, D] bf16 view the kernels can read.
    fn strides(what: &str, t: &Tensor) -> Result<[i64; 3]> {
        let l = t.layout();
        let s = l.stride();
        if t.dtype() != DType::BF16 || s.len() != 4 || s[3] != 1 {
            candle_core::bail!(
                "flash attention: {what} must be a bf16 [B, H, T, D] view with d contiguous, got {:?} {:?} strides {s:?}",
                t.dtype(),
                t.dims()
            );
        }
        if (s[0] | s[1] | s[2] | l.start_offset()) % 8 != 0 {
            candle_core::bail!("flash attention: {what}'s strides {s:?} are not multiples of 8");
        }
        Ok([s[0] as i64, s[1] as i64, s[2] as i64])
    }

    /// The order of `t`'s dims in memory, outermost first, when its view covers its span
    /// without gaps (so that an output laid out with the same strides is one allocation).
    fn dense_order(what: &str, t: &Tensor) -> Result<[usize; 4]> {
        let (dims, s) = (t.dims(), t.layout().stride());
        let mut order = [0usize, 1, 2, 3];
        order.sort_by_key(|&i| std::cmp::Reverse((s[i], dims[i] > 1, i)));
        let mut expect = 1;
        for &i in order.iter().rev() {
            if dims[i] > 1 && s[i] != expect {
                candle_core::bail!(
                    "flash attention: {what}'s layout has gaps ({dims:?}, strides {s:?})"
                );
            }
            expect *= dims[i];
        }
        Ok(order)
    }

    /// A fresh bf16 buffer shaped like `like` and laid out in `like`'s order, returned with
    /// the tensor that will view it once written.
    fn like(like: &Tensor, dev: &CudaDevice) -> Result<(CudaSlice<half::bf16>, [usize; 4])> {
        let order = dense_order("an output's model", like)?;
        // SAFETY: every element is written by the kernel before the tensor is read.
        let buf = unsafe { dev.alloc::<half::bf16>(like.elem_count())? };
        Ok((buf, order))
    }

    /// The strides of dims 0, 1, 2 of `dims` [B, H, T, D] stored densely in `order` (outermost
    /// first; d innermost).
    fn order_strides(dims: &[usize], order: [usize; 4]) -> [i64; 3] {
        let mut st = [0i64; 4];
        let mut s = 1i64;
        for &i in order.iter().rev() {
            st[i] = s;
            s *= dims[i] as i64;
        }
        [st[0], st[1], st[2]]
    }

    fn view(
        buf: CudaSlice<half::bf16>,
        dev: &CudaDevice,
        dims: &[usize],
        order: [usize; 4],
    ) -> Result<Tensor> {
        let stored: Vec<usize> = order.iter().map(|&i| dims[i]).collect();
        let t = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone())),
            stored,
            BackpropOp::none(),
            false,
        );
        let mut inv = [0usize; 4];
        for (j, &i) in order.iter().enumerate() {
            inv[i] = j;
        }
        t.permute(inv)
    }

    fn cuda_dev(t: &Tensor) -> Result<CudaDevice> {
        match t.device() {
            candle_core::Device::Cuda(d) => Ok(d.clone()),
            _ => candle_core::bail!("flash attention: tensors must be on the GPU"),
        }
    }

    fn check_shapes(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(usize, usize, usize, usize, usize)> {
        let (b, h, t, d) = q.dims4()?;
        let (kb, kh, kt, kd) = k.dims4()?;
        if (kb, kt, kd) != (b, t, d) || v.dims() != k.dims() || kh == 0 || h % kh != 0 {
            candle_core::bail!(
                "flash attention: q {:?}, k {:?}, v {:?} (want k, v [B, K, T, D] with K dividing H)",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        if !matches!(d, 64 | 96 | 128 | 256) {
            candle_core::bail!(
                "flash attention: head dim {d} (the kernels take 64, 96, 128 or 256)"
            );
        }
        Ok((b, h, kh, t, d))
    }

    fn launch(dev: &CudaDevice, name: &str, grid: (u32, u32), smem: u32, p: &FlashP) -> Result<()> {
        let func = crate::ops::cuda::function(dev, name)?;
        launch_fn(dev, func, THREADS, grid, smem, p, None)
    }

    fn launch90(
        dev: &CudaDevice,
        name: &str,
        threads: u32,
        grid: (u32, u32),
        smem: u32,
        p: &FlashP,
    ) -> Result<()> {
        let func = crate::ops::cuda::function90(dev, name)?;
        launch_fn(dev, func, threads, grid, smem, p, None)
    }

    fn launch_fn(
        dev: &CudaDevice,
        func: CudaFunction,
        threads: u32,
        grid: (u32, u32),
        smem: u32,
        p: &FlashP,
        tm: Option<&Tmaps>,
    ) -> Result<()> {
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let stream = dev.cuda_stream();
        let mut bld = stream.launch_builder(&func);
        bld.arg(p);
        if let Some(tm) = tm {
            bld.arg(tm);
        }
        // SAFETY: `p` (and the maps) point at live buffers of the sizes their dims say,
        // checked by the callers.
        unsafe { bld.launch(cfg) }.w()?;
        Ok(())
    }

    fn base(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttnMask, scale: f64) -> Result<FlashP> {
        let (b, h, kh, t, _) = check_shapes(q, k, v)?;
        // One thread block per (tile, batch·head): the grid's y side holds at most 65535.
        if b * h > 65535 {
            candle_core::bail!(
                "flash attention: batch × heads = {} exceeds 65535 blocks; use a smaller \
                 micro-batch",
                b * h
            );
        }
        let ints = |x: usize| {
            i32::try_from(x).map_err(|_| {
                candle_core::Error::Msg(format!("flash attention: {x} is out of range"))
            })
        };
        Ok(FlashP {
            sq: strides("q", q)?,
            sk: strides("k", k)?,
            sv: strides("v", v)?,
            b: ints(b)?,
            h: ints(h)?,
            kh: ints(kh)?,
            t: ints(t)?,
            window: ints(mask.window)?,
            scale: scale as f32,
            softcap: mask.softcap,
            tree: i32::from(mask.prefix_tree && mask.segments.is_some()),
            ..Default::default()
        })
    }

    fn seg_addr(
        mask: &AttnMask,
        b: usize,
        t: usize,
        stream: &CudaStream,
    ) -> Result<(u64, Option<Tensor>)> {
        let Some(seg) = &mask.segments else {
            return Ok((0, None));
        };
        let seg = seg.flatten_all()?.contiguous()?;
        if seg.dtype() != DType::U32 || seg.elem_count() != b * t {
            candle_core::bail!("flash attention: segment ids must be u32 [B·T]");
        }
        let a = {
            let (s, l) = seg.storage_and_layout();
            addr::<u32>(&s, l, stream)?
        };
        Ok((a, Some(seg)))
    }

    pub(crate) fn fwd(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        scale: f64,
        kernels: Attention,
    ) -> Result<(Tensor, Tensor)> {
        let mut p = base(q, k, v, mask, scale)?;
        let (b, h, t, d) = q.dims4()?;
        let dev = cuda_dev(q)?;
        let stream = dev.cuda_stream();
        // O goes out as rows [B·T, H·D]: element (b, h, t, d) at (b·T + t)·H·D + h·D + d.
        // SAFETY (o, lse): uninitialised; every kernel below writes each query's O row and
        // L, the grids covering all T queries of all B·H heads, before either is read.
        let o: CudaSlice<half::bf16> = unsafe { dev.alloc::<half::bf16>(b * h * t * d)? };
        // SAFETY: as o's.
        let lse: CudaSlice<f32> = unsafe { dev.alloc::<f32>(b * h * t)? };
        p.so = [(t * h * d) as i64, d as i64, (h * d) as i64];
        let (seg, _keep) = seg_addr(mask, b, t, &stream)?;
        p.seg = seg;
        {
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            p.q = addr::<half::bf16>(&qs, ql, &stream)?;
            p.k = addr::<half::bf16>(&ks, kl, &stream)?;
            p.v = addr::<half::bf16>(&vs, vl, &stream)?;
            p.o = o.device_ptr(&stream).0;
            p.lse = lse.device_ptr(&stream).0;
            match kernels {
                // The copy engine takes positive strides only (no broadcast views).
                // Warp-specialized (a producer warpgroup feeds the tiles through the copy
                // engine) where it can: no segments, no window.
                Attention::Wgmma | Attention::WgmmaSplitDq
                    if mask.segments.is_none()
                        && mask.window == 0
                        && [p.sq, p.sk, p.sv].iter().flatten().all(|&x| x > 0) =>
                {
                    wgmma_d(d, &p)?;
                    let kh = k.dim(1)?;
                    let (qm, qo) = tmap(p.q, [b, h, t], p.sq)?;
                    let (km, ko) = tmap(p.k, [b, kh, t], p.sk)?;
                    let (vm, vo) = tmap(p.v, [b, kh, t], p.sv)?;
                    let tm = Tmaps {
                        q: qm,
                        k: km,
                        v: vm,
                        ord: [qo, ko, vo],
                    };
                    // Q, K and V twice, as 128-row swizzled tiles; nine mbarriers; and room to
                    // align the tiles to 1024 bytes.
                    let smem = 5 * TILE128 + 9 * 8 + 1024;
                    let grid = (t.div_ceil(128) as u32, (b * h) as u32);
                    let func = crate::ops::cuda::function90(&dev, "flash_fwd90ws_d128")?;
                    // Two consumer warpgroups and a producer one.
                    launch_fn(&dev, func, 3 * 128, grid, smem, &p, Some(&tm))?;
                }
                Attention::Wgmma | Attention::WgmmaSplitDq => {
                    wgmma_d(d, &p)?;
                    // Q, K twice and V three times, as 128-row swizzled tiles; segment ids;
                    // and room to align the tiles to 1024 bytes.
                    let smem = 6 * TILE128 + 2 * 128 * 4 + 1024;
                    let grid = (t.div_ceil(128) as u32, (b * h) as u32);
                    launch90(&dev, "flash_fwd90_d128", THREADS90, grid, smem, &p)?;
                }
                Attention::Blockwise => {
                    candle_core::bail!("flash attention: Blockwise is ops::attention's path")
                }
                Attention::Wgmma256 => {
                    wgmma256_d(d)?;
                    // Q (128 rows of 256), K twice and V three times (64 rows), segment ids
                    // twice, room to align the tiles to 1024 bytes.
                    let tile = 64 * 256 * 2;
                    let smem = 2 * tile + 5 * tile + 2 * 64 * 4 + 1024;
                    let grid = (t.div_ceil(128) as u32, (b * h) as u32);
                    launch90(&dev, "flash_fwd90_d256", THREADS90, grid, smem, &p)?;
                }
                Attention::MmaSync => {
                    // K, V twice; Q unless in registers; segment ids.
                    let c = mma_cfg(d);
                    let q_rows = if c.rows_in_regs { 0 } else { 64 };
                    let smem = ((4 * c.fwd_bk + q_rows) * (d + 8) * 2 + 2 * c.fwd_bk * 4) as u32;
                    let grid = (t.div_ceil(64) as u32, (b * h) as u32);
                    launch(&dev, &format!("flash_fwd_d{d}"), grid, smem, &p)?;
                }
            }
        }
        let o = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone())),
            (b * t, h * d),
            BackpropOp::none(),
            false,
        );
        let lse = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev)),
            (b, h, t),
            BackpropOp::none(),
            false,
        );
        Ok((o, lse))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bwd(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_o: &Tensor,
        delta: &Tensor,
        lse: &Tensor,
        mask: &AttnMask,
        scale: f64,
        rope: Option<(&Tensor, &Tensor)>,
        kernels: Attention,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let mut p = base(q, k, v, mask, scale)?;
        let (b, h, kh, t, d) = check_shapes(q, k, v)?;
        if d_o.dims() != q.dims() {
            candle_core::bail!("flash attention: dO {:?} vs q {:?}", d_o.dims(), q.dims());
        }
        p.so = strides("dO", d_o)?;
        let (delta, lse) = (delta.contiguous()?, lse.contiguous()?);
        for (what, x) in [("δ", &delta), ("L", &lse)] {
            if x.dtype() != DType::F32 || x.dims() != [b, h, t] {
                candle_core::bail!(
                    "flash attention: {what} must be f32 [B, H, T], got {:?} {:?}",
                    x.dtype(),
                    x.dims()
                );
            }
        }
        let dev = cuda_dev(q)?;
        let stream = dev.cuda_stream();
        // With RoPE's backward in the stores, dq and dk are written as token-major rows.
        let rows_order = [0usize, 2, 1, 3]; // (b, t, h, d)
        let fresh = |like_t: &Tensor| -> Result<(CudaSlice<half::bf16>, [usize; 4])> {
            match rope {
                // SAFETY: every element is written by the kernel before the tensor is read.
                Some(_) => Ok((
                    unsafe { dev.alloc::<half::bf16>(like_t.elem_count())? },
                    rows_order,
                )),
                None => like(like_t, &dev),
            }
        };
        let (dq, oq) = fresh(q)?;
        let (dk, ok) = fresh(k)?;
        let (dv, ov) = like(v, &dev)?;
        p.sdq = order_strides(q.dims(), oq);
        p.sdk = order_strides(k.dims(), ok);
        let (seg, _keep) = seg_addr(mask, b, t, &stream)?;
        p.seg = seg;
        let rope = match rope {
            Some((c, s)) => {
                let (c, s) = (c.contiguous()?, s.contiguous()?);
                for (what, x) in [("cos", &c), ("sin", &s)] {
                    if x.dtype() != DType::F32 || x.dims() != [b, t, d / 2] {
                        candle_core::bail!(
                            "flash attention: RoPE's {what} must be f32 [B, T, D/2] = [{b}, {t}, {}], got {:?} {:?}",
                            d / 2,
                            x.dtype(),
                            x.dims()
                        );
                    }
                }
                Some((c, s))
            }
            None => None,
        };
        if let Some((c, s)) = &rope {
            let (cs, cl) = c.storage_and_layout();
            let (ss, sl) = s.storage_and_layout();
            p.rc = addr::<f32>(&cs, cl, &stream)?;
            p.rs = addr::<f32>(&ss, sl, &stream)?;
        }
        {
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let (os, ol) = d_o.storage_and_layout();
            let (ds, dl) = delta.storage_and_layout();
            let (ls, ll) = lse.storage_and_layout();
            p.q = addr::<half::bf16>(&qs, ql, &stream)?;
            p.k = addr::<half::bf16>(&ks, kl, &stream)?;
            p.v = addr::<half::bf16>(&vs, vl, &stream)?;
            p.o = addr::<half::bf16>(&os, ol, &stream)?;
            p.delta = addr::<f32>(&ds, dl, &stream)?;
            p.lse = addr::<f32>(&ls, ll, &stream)?;
            p.dq = dq.device_ptr(&stream).0;
            p.dk = dk.device_ptr(&stream).0;
            p.dv = dv.device_ptr(&stream).0;
            bwd_launches(&dev, &mut p, kernels, (b, h, kh, t, d))?;
        }
        Ok((
            view(dq, &dev, q.dims(), oq)?,
            view(dk, &dev, k.dims(), ok)?,
            view(dv, &dev, v.dims(), ov)?,
        ))
    }

    /// flash90.cu's backward at head dim 256 over `p` (every address set): dQ, then dK and dV.
    fn bwd90_d256(
        dev: &CudaDevice,
        p: &FlashP,
        (b, h, kh, t, d): (usize, usize, usize, usize, usize),
    ) -> Result<()> {
        wgmma256_d(d)?;
        // Bytes of a 64-row tile of head dim 256.
        let tile = 64 * 256 * 2;
        // dQ: Q and dO (128 rows), K and V three times (32 rows); segment ids three times;
        // room to align the tiles to 1024 bytes.
        let smem = 4 * tile + 6 * tile / 2 + 3 * 32 * 4 + 1024;
        let grid = (t.div_ceil(128) as u32, (b * h) as u32);
        launch90(dev, "flash_dq90_d256", THREADS90, grid, smem, p)?;
        // dK, dV: K and V (64 rows), Q and dO twice (64 rows); Pᵀ and dSᵀ [64 × 64] bf16; L, δ
        // and segment ids twice; room to align.
        let smem = 2 * tile + 4 * tile + 2 * 64 * 64 * 2 + 6 * 64 * 4 + 1024;
        let grid = (t.div_ceil(64) as u32, (b * kh) as u32);
        launch90(dev, "flash_dkdv90_d256", THREADS90, grid, smem, p)
    }

    /// Queues the backward's kernels of family `kernels` over `p` (every address set): q
    /// [B, H, T, D], k and v [B, K, T, D], `bhktd` = (B, H, K, T, D).
    fn bwd_launches(
        dev: &CudaDevice,
        p: &mut FlashP,
        kernels: Attention,
        (b, h, kh, t, d): (usize, usize, usize, usize, usize),
    ) -> Result<()> {
        let stream = dev.cuda_stream();
        // K and V (128 rows), Q and dO three times (64 rows); L, δ and segment ids three
        // times; room to align the tiles to 1024 bytes.
        let dkdv_smem = 2 * TILE128 + 3 * TILE128 + 9 * 64 * 4 + 1024;
        match kernels {
            Attention::Wgmma => {
                wgmma_d(d, p)?;
                // dQ's f32 sums, zeroed (the kernel adds each key tile's terms in), in
                // tiles of 64 rows (T rounded up): twice dq's bytes, alive through this
                // call only.
                let tiles64 = b * h * t.div_ceil(64);
                let acc = dev.alloc_zeros::<f32>(tiles64 * 64 * d)?;
                p.dqacc = acc.device_ptr(&stream).0;
                // dkdv's tiles, then at the next 1024-byte boundary dSᵀ [128 × 64] bf16
                // and a pair's dQ terms [64 × 128] f32.
                let smem = dkdv_smem + 1024 + TILE128 / 2 + 64 * 128 * 4;
                let grid = (t.div_ceil(128) as u32, (b * kh) as u32);
                launch90(dev, "flash_bwd90_d128", THREADS90, grid, smem, p)?;
                // A block a tile (its shared copy is static).
                launch90(dev, "flash_dq_rows90", THREADS90, (tiles64 as u32, 1), 0, p)?;
            }
            Attention::WgmmaSplitDq => {
                wgmma_d(d, p)?;
                let tiles = t.div_ceil(128) as u32;
                // A 64-row tile is half a 128-row one. dQ: Q and dO (128 rows), K and V
                // three times (64 rows); segment ids; and room to align the tiles to 1024
                // bytes.
                let half = TILE128 / 2;
                let smem = 2 * TILE128 + 6 * half + 3 * 64 * 4 + 1024;
                launch90(
                    dev,
                    "flash_dq90_d128",
                    THREADS90,
                    (tiles, (b * h) as u32),
                    smem,
                    p,
                )?;
                launch90(
                    dev,
                    "flash_dkdv90_d128",
                    THREADS90,
                    (tiles, (b * kh) as u32),
                    dkdv_smem,
                    p,
                )?;
            }
            Attention::Blockwise => {
                candle_core::bail!("flash attention: Blockwise is ops::attention's path")
            }
            Attention::Wgmma256 => bwd90_d256(dev, p, (b, h, kh, t, d))?,
            Attention::MmaSync => {
                let c = mma_cfg(d);
                let rows = (d + 8) * 2; // bytes of one padded shared-memory row
                let tiles = t.div_ceil(64) as u32;
                // dQ: K and V twice; Q and dO unless in registers; segment ids.
                let q_rows = if c.rows_in_regs { 0 } else { 2 * 64 };
                launch(
                    dev,
                    &format!("flash_dq_d{d}"),
                    (tiles, (b * h) as u32),
                    ((4 * c.dq_bk + q_rows) * rows + 2 * c.dq_bk * 4) as u32,
                    p,
                )?;
                // dK, dV: K and V (64 rows), Q and dO twice (32 rows); L, δ and segment ids
                // twice; paired warps' exchange: P and its capped factor, 16 floats a lane
                // of 4 pairs.
                let pairs = if c.dkdv_threads > THREADS {
                    2 * 4 * 32 * 16 * 4
                } else {
                    0
                };
                let func = crate::ops::cuda::function(dev, &format!("flash_dkdv_d{d}"))?;
                launch_fn(
                    dev,
                    func,
                    c.dkdv_threads,
                    (tiles, (b * kh) as u32),
                    (256 * rows + 6 * 32 * 4 + pairs) as u32,
                    p,
                    None,
                )?;
            }
        }
        Ok(())
    }
}
