//! decode.cu's kernels for one-token steps on CUDA: attention over the cache split along the
//! keys with RoPE of q and k, the cache write and the merge of the splits in it (one launch
//! instead of two RoPEs, a copy, two slice writes, two GEMMs, a scale, casts and a softmax),
//! and the bf16 products of one token with a weight (a GEMV, with the adapter's term and the
//! bias added in it). Compiled once per process with NVRTC, as `ops`' kernels are.
//!
//! Elsewhere (other dtypes, head dims) candle's ops run every step.

use super::weights::{Matvec, Weights};
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::{sys, CudaFunction, CudaModule, DevicePtr, LaunchConfig};
use candle_core::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Threads a block of the attention kernel (4 warps: decode.cu's `sm` holds 4).
const THREADS: u32 = 128;
/// Keys a split takes at least: one group of decode.cu's KEYS per warp.
const MIN_CHUNK: usize = 16;

/// decode.cu for sm_80 on, and for sm_90 on with programmatic dependent launch.
static PTX: [OnceLock<std::result::Result<Ptx, String>>; 2] = [OnceLock::new(), OnceLock::new()];
static MODULES: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>> = OnceLock::new();

/// The program for `dev`'s context, compiled once per process for its kind (`pdl`: sm_90+).
fn module(dev: &CudaDevice, pdl: bool) -> Result<Arc<CudaModule>> {
    let ptx = PTX[pdl as usize]
        .get_or_init(|| {
            let opts = CompileOptions {
                arch: Some(if pdl { "sm_90" } else { "sm_80" }),
                ..Default::default()
            };
            // the shared helpers first, as ops::cuda joins its sources
            let body = concat!(include_str!("../ops/common.cuh"), include_str!("decode.cu"));
            let src = format!("{}{body}", if pdl { "#define PDL 1\n" } else { "" });
            compile_ptx_with_opts(src, opts).map_err(|e| format!("{e:?}"))
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("NVRTC failed to compile generate/decode.cu: {e}"))?;
    let ctx = dev.cuda_stream().context().clone();
    let key = Arc::as_ptr(&ctx) as usize;
    let mut mods = MODULES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| anyhow::anyhow!("decode kernel cache poisoned"))?;
    if let Some(m) = mods.get(&key) {
        return Ok(m.clone());
    }
    let m = ctx.load_module(ptx.clone()).w()?;
    mods.insert(key, m.clone());
    Ok(m)
}

/// The addresses of a kernel's argument values, in order, for `Kernels::launch`.
macro_rules! kernel_args {
    ($($a:expr),* $(,)?) => { [$(($a) as *const _ as *mut std::ffi::c_void),*] };
}

/// The kernels for one model's shape and dtype.
pub(crate) struct Kernels {
    dev: CudaDevice,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Blocks the attention aims for (eight per multiprocessor: a warp's few keys are a few
    /// round trips to memory, and the blocks are small).
    blocks: usize,
    /// Warps the device keeps resident at once (multiprocessors × warps a multiprocessor).
    warp_slots: usize,
    /// Launches may start before the kernel ahead ends (sm_90 on: decode.cu's DEP_WAIT).
    pdl: bool,
    step: CudaFunction,
    /// u32 [H], zero between launches: the attention's finished splits per head.
    done: Tensor,
    /// bf16 models: the product, and with SwiGLU.
    gemv: Option<(CudaFunction, CudaFunction)>,
}

impl Kernels {
    /// The kernels when `w` is on CUDA in bf16 or f32 with a head dim they take (even, ≤ 256);
    /// None otherwise.
    pub(crate) fn for_model(w: &Weights) -> Result<Option<Kernels>> {
        let Device::Cuda(dev) = &w.device else {
            return Ok(None);
        };
        let c = &w.cfg;
        let s = match w.dtype {
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            _ => return Ok(None),
        };
        if c.head_dim % 2 != 0 || c.head_dim > 256 || c.num_heads % c.num_kv_heads != 0 {
            return Ok(None);
        }
        use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
        let attr = |a| dev.cuda_stream().context().attribute(a).w();
        let pdl = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? >= 9;
        let m = module(dev, pdl)?;
        let f = |n: &str| m.load_function(&format!("gen_{n}_{s}")).w();
        let sms = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1);
        let threads =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?.max(32);
        Ok(Some(Kernels {
            dev: dev.clone(),
            dtype: w.dtype,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            blocks: 8 * sms as usize,
            warp_slots: (sms * threads / 32) as usize,
            pdl,
            step: f("attn_step")?,
            done: Tensor::zeros(c.num_heads, DType::U32, &w.device)?,
            gemv: match w.dtype {
                DType::BF16 => Some((
                    m.load_function("gen_gemv_bf16").w()?,
                    m.load_function("gen_gemv_swiglu_bf16").w()?,
                )),
                _ => None,
            },
        }))
    }

    /// The split of a cache of `cap` keys for the attention kernel: (chunk, splits), so that
    /// H × splits ≈ `blocks` and the chunks cover the cache (fixed per cache, so that a graph
    /// replays at every position).
    fn splits(&self, cap: usize) -> (usize, usize) {
        let want = self.blocks.div_ceil(self.heads).max(1);
        let chunk = cap.div_ceil(want).max(MIN_CHUNK);
        (chunk, cap.div_ceil(chunk))
    }

    /// Attention of one token's q [1, H·D], k, v [1, K·D] (before RoPE) at the position `pos`
    /// holds (u32 [1] on the device) against the cache's keys up to it (the last `window` of
    /// them; 0: all) → [1, H·D]; k rotated and v are written into the caches kc, vc [1, K, cap,
    /// D] there. cos, sin: the cache's tables [1, cap, D/2] f32. Scores × `scale`, then
    /// soft-capped at `softcap` (0: none).
    pub(crate) fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (pos, (cos, sin)): (&Tensor, (&Tensor, &Tensor)),
        (kc, vc): (&Tensor, &Tensor),
        (window, scale, softcap): (usize, f32, f32),
    ) -> Result<Tensor> {
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        let cap = kc.dim(2)?;
        if q.elem_count() != h * d || k.elem_count() != kvh * d || v.elem_count() != kvh * d {
            bail!(
                "attention: q {:?} k {:?} v {:?} are not one token's",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        if kc.dims() != [1, kvh, cap, d] || vc.dims() != kc.dims() || pos.dtype() != DType::U32 {
            bail!(
                "attention: cache {:?} is not [1, {kvh}, cap, {d}]",
                kc.dims()
            );
        }
        if cos.dims() != [1, cap, d / 2] || sin.dims() != cos.dims() {
            bail!("attention: tables {:?} for a cache of {cap}", cos.dims());
        }
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let (chunk, splits) = self.splits(cap);
        let part = self.fresh(DType::F32, h * splits * (d + 2))?;
        let o = self.fresh(self.dtype, h * d)?;
        let ptrs = [&q, &k, &v, cos, sin, kc, vc, &part, &self.done, &o, pos]
            .iter()
            .map(|t| addr(t))
            .collect::<Result<Vec<u64>>>()?;
        let ints = [h, kvh, d].map(|x| x as i32);
        let (cap_i, window_i, chunk_i) = (
            cap as i64,
            window.min(i32::MAX as usize) as i32,
            chunk as i32,
        );
        let p = &ptrs;
        let mut args = kernel_args![
            &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &p[7], &p[8], &p[9], &ints[0],
            &ints[1], &ints[2], &cap_i, &p[10], &window_i, &chunk_i, &scale, &softcap,
        ];
        let cfg = LaunchConfig {
            grid_dim: (h as u32, splits as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments are decode.cu's gen_attn_step's, in order. q, k, v hold one
        // token's H·D and K·D values, the tables cap × D/2 f32, the caches K × cap × D (keys
        // read below min(pos + 1, cap), the row at pos written once), pos one u32, part fresh
        // with H × splits × (D + 2) f32 (each block writes its own D + 2 before the last reads
        // them), done H u32 left zero, o fresh with H·D (each written once, by the last block
        // of its head); same device and stream.
        unsafe { self.launch(&self.step, cfg, &mut args) }?;
        drop(part);
        Ok(o.reshape((1, h * d))?)
    }

    /// A fresh contiguous tensor of `n` elements whose contents the kernel writes.
    fn fresh(&self, dtype: DType, n: usize) -> Result<Tensor> {
        // SAFETY: every caller's kernel writes each element before anything reads it.
        let s = unsafe {
            match dtype {
                DType::BF16 => {
                    CudaStorage::wrap_cuda_slice(self.dev.alloc::<half::bf16>(n)?, self.dev.clone())
                }
                DType::F32 => {
                    CudaStorage::wrap_cuda_slice(self.dev.alloc::<f32>(n)?, self.dev.clone())
                }
                d => bail!("decode kernels take bf16 or f32, not {d:?}"),
            }
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(s),
            n,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

impl Kernels {
    /// Launches `f` on the device's stream; on sm_90 and later it may start before the kernel
    /// ahead of it ends (programmatic dependent launch: decode.cu's kernels read what that
    /// kernel writes only after DEP_WAIT).
    ///
    /// # Safety
    /// `args` hold the addresses of values of `f`'s parameter types, in order, live for the
    /// call; what the kernel reads and writes lies within live buffers of this device.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let stream = self.dev.cuda_stream();
        stream.context().bind_to_thread().w()?;
        // SAFETY: a plain C struct of which all zeros is a valid value (no attribute, 0).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: self.pdl as u32,
        };
        // SAFETY: the caller's; lc and attr outlive the call, f is loaded in this context.
        unsafe {
            sys::cuLaunchKernelEx(
                &lc,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .w()?;
        Ok(())
    }
}

/// Rows of a GEMV block (warps).
const GEMV_ROWS: u32 = 8;

impl Kernels {
    /// The operands' addresses and W's row stride when gen_gemv_* can take them: every operand
    /// bf16 on this device, x [1, k] and acc contiguous, W [n, k] with rows contiguous and
    /// 16-byte aligned, k a multiple of 8. (x, W, ld, acc or 0).
    fn gemv_operands(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: Option<&Tensor>,
        acc_n: usize,
    ) -> Result<Option<(u64, u64, i64, u64)>> {
        let (Ok((1, k)), Ok((_, wk)), &[ld, 1]) = (x.dims2(), w.dims2(), w.stride()) else {
            return Ok(None);
        };
        let ops = [Some(x), Some(w), acc];
        let here = Device::Cuda(self.dev.clone());
        let bf16 = ops
            .iter()
            .flatten()
            .all(|t| t.dtype() == DType::BF16 && t.device().same_device(&here));
        let acc_ok = acc.is_none_or(|a| a.elem_count() == acc_n && a.is_contiguous());
        if !bf16 || !acc_ok || wk != k || k % 8 != 0 || ld % 8 != 0 || !x.is_contiguous() {
            return Ok(None);
        }
        let (xp, wp) = (first(x)?, first(w)?);
        if xp % 16 != 0 || wp % 16 != 0 {
            return Ok(None);
        }
        let ap = acc.map(first).transpose()?.unwrap_or(0);
        Ok(Some((xp, wp, ld as i64, ap)))
    }

    fn gemv_cfg(rows: usize, parts: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(GEMV_ROWS / parts), 1, 1),
            block_dim: (32 * GEMV_ROWS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Warps per row of gen_gemv_bf16 for a weight of `rows` rows: as many as keep every
    /// row's warps within the device's resident warps (1 to 8, a power of two).
    fn gemv_parts(&self, rows: usize) -> u32 {
        let mut p = 1;
        while p < GEMV_ROWS && rows * 2 * p as usize <= self.warp_slots {
            p *= 2;
        }
        p
    }
}

impl Matvec for Kernels {
    /// decode.cu's gen_gemv_bf16 (`gemv_operands` says when).
    fn matvec(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: Option<&Tensor>,
        b: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let (Some((func, _)), Ok(n)) = (&self.gemv, w.dim(0)) else {
            return Ok(None);
        };
        let Some((xp, wp, ld, ap)) = self.gemv_operands(x, w, acc, n)? else {
            return Ok(None);
        };
        let here = Device::Cuda(self.dev.clone());
        let bp = match b {
            None => 0,
            Some(b)
                if b.elem_count() == n
                    && b.is_contiguous()
                    && b.dtype() == DType::BF16
                    && b.device().same_device(&here) =>
            {
                first(b)?
            }
            Some(_) => return Ok(None),
        };
        if n == 0 {
            return Ok(None);
        }
        let k = w.dim(1)? as i32;
        let y = self.fresh(DType::BF16, n)?;
        let (yp, ni) = (addr(&y)?, n as i32);
        let parts = self.gemv_parts(n);
        let parts_i = parts as i32;
        let mut args = kernel_args![&xp, &wp, &ld, &ap, &bp, &yp, &ni, &k, &parts_i];
        // SAFETY: the arguments are gen_gemv_bf16's, in order. x holds k bf16 values, W n rows
        // of k at `ld` (rows and both starts 16-byte aligned, k a multiple of 8: the kernel's
        // 16-byte loads stay inside), acc and the bias n each or null, y fresh with n (each
        // written once); one device and stream.
        unsafe { self.launch(func, Self::gemv_cfg(n, parts), &mut args) }?;
        Ok(Some(y.reshape((1, n))?))
    }

    /// decode.cu's gen_gemv_swiglu_bf16 for W [2I, k] (`gemv_operands` says when).
    fn matvec_swiglu(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let (Some((_, func)), Ok(n2)) = (&self.gemv, w.dim(0)) else {
            return Ok(None);
        };
        if n2 == 0 || n2 % 2 != 0 {
            return Ok(None);
        }
        let Some((xp, wp, ld, ap)) = self.gemv_operands(x, w, acc, n2)? else {
            return Ok(None);
        };
        let (i, k) = (n2 / 2, w.dim(1)? as i32);
        let y = self.fresh(DType::BF16, i)?;
        let (yp, ii) = (addr(&y)?, i as i32);
        let mut args = kernel_args![&xp, &wp, &ld, &ap, &yp, &ii, &k];
        // SAFETY: as `matvec`, gen_gemv_swiglu_bf16's arguments, with W 2I rows and acc 2I
        // values or null; y fresh with I.
        unsafe { self.launch(func, Self::gemv_cfg(i, 1), &mut args) }?;
        Ok(Some(y.reshape((1, i))?))
    }
}

/// Makes allocations on `device` skip the events cudarc keeps for synchronising several
/// streams (two created and destroyed per tensor: a tenth of a 7B decode step's host time).
/// For processes that use one stream only (`generate`, its bench); the trainer's side streams
/// (offload, NCCL) need them.
pub(crate) fn single_stream(device: &Device) {
    if let Device::Cuda(d) = device {
        // SAFETY: the callers run every kernel and copy on candle's one stream of this device,
        // so no allocation needs cross-stream events.
        unsafe { d.disable_event_tracking() };
    }
}

/// The device address of a contiguous bf16, f32 or u32 CUDA tensor's first element.
pub(crate) fn addr(t: &Tensor) -> Result<u64> {
    if !t.is_contiguous() {
        bail!("decode kernel operand {:?} is not contiguous", t.dims());
    }
    first(t)
}

/// The device address of a bf16 or f32 CUDA tensor's first element, whatever its strides.
fn first(t: &Tensor) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*s else {
        bail!("decode kernel operand is not on the GPU");
    };
    let stream = cs.device.cuda_stream();
    let off = (l.start_offset() * t.dtype().size_in_bytes()) as u64;
    let p = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        d => bail!("decode kernels take bf16, f32 or u32, not {d:?}"),
    };
    Ok(p + off)
}
