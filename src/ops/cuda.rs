//! Our CUDA kernels' one NVRTC program, and the pointer and layout helpers their launchers share.
//!
//! Each op owns its kernels (a `.cu` file beside it, e.g. rms_norm.cu) and their launchers (a
//! `cuda` module in its own file); here the sources are joined, common.cuh first, into one
//! program compiled once per process with NVRTC for the device's architecture (the build needs
//! no nvcc of its own) and loaded once per CUDA context. bf16 is handled as raw 16-bit storage
//! with PTX conversions (sm_80+), so the sources need no CUDA headers. Math is f32 throughout.

use candle_core::cuda::cudarc::driver::{CudaFunction, CudaModule, CudaStream};
use candle_core::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// One NVRTC program: compiled once per process, loaded once per CUDA context.
struct Program {
    arch: &'static str,
    src: fn() -> String,
    ptx: OnceLock<std::result::Result<Ptx, String>>,
    modules: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>>,
}

/// Every kernel of ours, for sm_80 and later (mma.sync, cp.async).
static PORTABLE: Program = Program {
    arch: "sm_80",
    src: || {
        [
            include_str!("common.cuh"),
            include_str!("rms_norm.cu"),
            include_str!("rope.cu"),
            include_str!("attention.cu"),
            include_str!("glu.cu"),
            include_str!("softcap.cu"),
            include_str!("add.cu"),
            include_str!("flash.cu"),
            include_str!("multi_tensor.cu"),
            include_str!("cross_entropy.cu"),
            include_str!("dropout.cu"),
            include_str!("fold_bwd.cu"),
            include_str!("fold_drop.cu"),
            include_str!("moe_rows.cu"),
            include_str!("../quant/nf4.cu"),
        ]
        .join("\n")
    },
    ptx: OnceLock::new(),
    modules: OnceLock::new(),
};

/// flash90.cu's wgmma kernels (over flash.cu's helpers, without its kernels), for compute
/// capability 9.0 only: sm_90a code runs on no other architecture.
static HOPPER: Program = Program {
    arch: "sm_90a",
    src: || {
        format!(
            "typedef unsigned short bf16_t;\n#define FLASH_HELPERS_ONLY\n{}{}",
            include_str!("flash.cu"),
            include_str!("flash90.cu")
        )
    },
    ptx: OnceLock::new(),
    modules: OnceLock::new(),
};

fn module(dev: &CudaDevice, prog: &'static Program) -> Result<Arc<CudaModule>> {
    let ptx = prog
        .ptx
        .get_or_init(|| {
            let opts = CompileOptions {
                arch: Some(prog.arch),
                ..Default::default()
            };
            compile_ptx_with_opts((prog.src)(), opts).map_err(|e| format!("{e:?}"))
        })
        .as_ref()
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "NVRTC failed to compile our kernels for {}: {e}",
                prog.arch
            ))
        })?;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let key = Arc::as_ptr(ctx) as usize;
    let mut mods = prog
        .modules
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel module cache poisoned".into()))?;
    if let Some(m) = mods.get(&key) {
        return Ok(m.clone());
    }
    let m = ctx.load_module(ptx.clone()).w()?;
    mods.insert(key, m.clone());
    Ok(m)
}

/// Whether `dev` is a Hopper GPU (compute capability 9.0), where flash90.cu's kernels run.
pub(crate) fn is_hopper(dev: &CudaDevice) -> Result<bool> {
    Ok(dev.cuda_stream().context().compute_capability().w()? == (9, 0))
}

/// The device address of `t`'s first element when `t` is a contiguous bf16, f16, f32 or u32
/// (indices) CUDA tensor; None otherwise.
pub(crate) fn addr(t: &candle_core::Tensor) -> Result<Option<u64>> {
    if !t.is_contiguous() {
        return Ok(None);
    }
    first(t)
}

/// The device address of `t`'s first element and its row stride in elements when `t` is a 2-D
/// bf16, f16 or f32 CUDA tensor whose rows are contiguous (stride [ld, 1], ld ≥ columns): a
/// column slice of a wider matrix, as cuBLAS takes it with its leading dimension. None otherwise.
pub(crate) fn addr_rows(t: &candle_core::Tensor) -> Result<Option<(u64, usize)>> {
    let (Ok((_, n)), &[ld, 1]) = (t.dims2(), t.stride()) else {
        return Ok(None);
    };
    if ld < n {
        return Ok(None);
    }
    Ok(first(t)?.map(|p| (p, ld)))
}

/// The device address of `t`'s first element and the stride between its matrices (elements)
/// when `t` is a 3-D bf16, f16 or f32 CUDA tensor whose matrices each lie contiguous (strides
/// [s, columns, 1]), as a stack of matrices narrowed along their rows does. None otherwise.
pub(crate) fn addr_batched(t: &candle_core::Tensor) -> Result<Option<(u64, usize)>> {
    let (Ok((_, _, n)), &[s, ld, 1]) = (t.dims3(), t.stride()) else {
        return Ok(None);
    };
    if ld != n {
        return Ok(None);
    }
    Ok(first(t)?.map(|p| (p, s)))
}

/// A fresh contiguous bf16, f16, f32 or u8 tensor of `shape` on `dev` whose contents are not set,
/// for an output that a GEMM or a collective writes whole; None for other dtypes.
///
/// # Safety
/// Every element must be written before any is read.
pub(crate) unsafe fn uninit<S: Into<candle_core::Shape>>(
    dev: &CudaDevice,
    dtype: DType,
    shape: S,
) -> Result<Option<candle_core::Tensor>> {
    let shape = shape.into();
    let n = shape.elem_count();
    let s = match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(n)?, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(n)?, dev.clone()),
        DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(n)?, dev.clone()),
        DType::U8 => CudaStorage::wrap_cuda_slice(dev.alloc::<u8>(n)?, dev.clone()),
        _ => return Ok(None),
    };
    Ok(Some(candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )))
}

/// The device address of `t`'s first element (its layout's start), whatever its strides.
fn first(t: &candle_core::Tensor) -> Result<Option<u64>> {
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*s else {
        return Ok(None);
    };
    let stream = cs.device.cuda_stream();
    let off = l.start_offset() as u64 * t.dtype().size_in_bytes() as u64;
    let p = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        _ => return Ok(None),
    };
    Ok(Some(p + off))
}

/// Our kernel `name` on `dev`.
pub(crate) fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    module(dev, &PORTABLE)?.load_function(name).w()
}

/// flash90.cu's kernel `name` on `dev`, a Hopper GPU.
pub(crate) fn function90(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    module(dev, &HOPPER)?.load_function(name).w()
}

/// Our kernel `name_<dtype of s>` and the stream of `s`'s device.
pub(crate) fn kernel(s: &CudaStorage, name: &str) -> Result<(CudaFunction, Arc<CudaStream>)> {
    use candle_core::backend::BackendStorage;
    let func = module(s.device(), &PORTABLE)?
        .load_function(&format!("{name}_{}", suffix(s.dtype())?))
        .w()?;
    Ok((func, s.device().cuda_stream()))
}

fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
    }
}

/// `$body` with `$v` bound to the f32 or bf16 device view of `$s[$range]`.
macro_rules! with_view {
    ($s:expr, $range:expr, |$v:ident| $body:block) => {{
        match $s.dtype() {
            candle_core::DType::F32 => {
                let $v = $s.as_cuda_slice::<f32>()?.slice($range);
                $body
            }
            candle_core::DType::BF16 => {
                let $v = $s.as_cuda_slice::<half::bf16>()?.slice($range);
                $body
            }
            d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
        }
    }};
}
pub(crate) use with_view;

/// Runs `$body` with `$x` the f32 or bf16 device view of `$s` as `$l` lays it out (contiguous)
/// and `$out` a fresh output of `$n` elements of that dtype; evaluates to the output's storage.
/// `$out` is uninitialised: `$body` must launch a kernel that writes every element of it.
macro_rules! with_dtype {
    ($s:expr, $l:expr, $n:expr, |$x:ident, $out:ident| $body:block) => {{
        let dev = $s.device.clone();
        match $s.dtype() {
            candle_core::DType::F32 => {
                let (o1, o2) = $crate::ops::cuda::contiguous($l)?;
                let $x = $s.as_cuda_slice::<f32>()?.slice(o1..o2);
                // SAFETY: the macro's contract: `$body` launches a kernel that writes all `$n`
                // elements of `$out` before the storage is returned to be read.
                let $out: candle_core::cuda::cudarc::driver::CudaSlice<f32> =
                    unsafe { dev.alloc::<f32>($n)? };
                $body;
                candle_core::CudaStorage::wrap_cuda_slice($out, dev)
            }
            candle_core::DType::BF16 => {
                let (o1, o2) = $crate::ops::cuda::contiguous($l)?;
                let $x = $s.as_cuda_slice::<half::bf16>()?.slice(o1..o2);
                // SAFETY: as the f32 arm's.
                let $out: candle_core::cuda::cudarc::driver::CudaSlice<half::bf16> =
                    unsafe { dev.alloc::<half::bf16>($n)? };
                $body;
                candle_core::CudaStorage::wrap_cuda_slice($out, dev)
            }
            d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
        }
    }};
}
pub(crate) use with_dtype;

/// The start and end offsets of a contiguous layout (an error otherwise).
pub(crate) fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("kernel input not contiguous".into()))
}

/// Whether rows of `d` bf16 values starting at these layouts' offsets can go 8 a thread
/// (allocations are 256-byte aligned, so an offset of 8 elements is 16 bytes).
pub(crate) fn v8_rows(x: &CudaStorage, layouts: &[&Layout], d: usize) -> bool {
    use candle_core::backend::BackendStorage;
    x.dtype() == DType::BF16 && d % 8 == 0 && layouts.iter().all(|l| l.start_offset() % 8 == 0)
}

/// The launch of one thread for each of `n` items (`LaunchConfig::for_num_elems`), refused
/// when `n` exceeds the kernels' 32-bit thread count, where a truncated grid would leave items
/// untouched. At hidden 4096 that is a micro-batch of over a million tokens.
pub(crate) fn elems(n: usize) -> Result<candle_core::cuda::cudarc::driver::LaunchConfig> {
    match u32::try_from(n) {
        Ok(n) => Ok(candle_core::cuda::cudarc::driver::LaunchConfig::for_num_elems(n)),
        Err(_) => Err(candle_core::Error::Msg(format!(
            "a kernel over {n} items exceeds the 2^32 threads of one launch: shorten data.seq_len or train.micro_batch"
        ))),
    }
}

/// Threads for a block over rows of `n` elements: `n` rounded up to warps, 32 to 1024.
pub(crate) fn threads_for(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// The addresses of bf16 CUDA tensors that are each contiguous and on 16 bytes (the loads of
/// the 8-a-thread kernels); None if any is not.
pub(crate) fn v8_addrs<const N: usize>(ts: [&candle_core::Tensor; N]) -> Result<Option<[u64; N]>> {
    let mut out = [0u64; N];
    for (o, t) in out.iter_mut().zip(ts) {
        match (t.dtype(), addr(t)?) {
            (DType::BF16, Some(p)) if p % 16 == 0 => *o = p,
            _ => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// A fresh bf16 [rows, ld] and its address, for a kernel that writes the first columns of
/// each row (`ops::fold`'s padded rows).
///
/// # Safety
/// As `uninit`: every element must be written before it is read.
pub(crate) unsafe fn padded_rows(
    dev: &CudaDevice,
    rows: usize,
    ld: usize,
) -> Result<Option<(candle_core::Tensor, u64)>> {
    // SAFETY: the caller's contract.
    let Some(t) = (unsafe { uninit(dev, DType::BF16, (rows, ld))? }) else {
        return Ok(None);
    };
    Ok(addr(&t)?.map(|p| (t, p)))
}
