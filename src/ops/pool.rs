//! The device's memory pool as the step and the plan see it: its high-water marks (CUDA), the
//! pool kept rather than returned to the driver, the card's free memory, an out-of-memory
//! recognised in an error chain, and the CPU accounting that gives a CPU run the same
//! out-of-memory path (`train.max_memory` on the CPU).
//!
//! candle allocates with cuMemAllocAsync from the device's default pool. We keep the pool's
//! memory (release threshold = max, so freed blocks are reused instead of returned to the
//! driver on every synchronisation) and read its peak use, which is what decides an OOM.

use candle_core::{Device, Result};
use std::cell::Cell;

/// Bytes in use now and at the peak since the last reset (None on the CPU).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(crate) struct PoolStats {
    pub(crate) used: u64,
    pub(crate) used_high: u64,
    pub(crate) reserved_high: u64,
}

#[cfg(feature = "cuda")]
mod imp {
    use super::PoolStats;
    use candle_core::cuda::cudarc::driver::sys;
    use candle_core::{Device, Result};

    fn pool(dev: &Device) -> Result<Option<sys::CUmemoryPool>> {
        let Device::Cuda(cuda) = dev else {
            return Ok(None);
        };
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: FFI with a valid out-pointer and the context's own device.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
            .result()
            .map_err(candle_core::Error::wrap)?;
        Ok(Some(pool))
    }

    fn attr(p: sys::CUmemoryPool, a: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: these attributes are 64-bit values.
        unsafe { sys::cuMemPoolGetAttribute(p, a, &mut v as *mut u64 as *mut std::ffi::c_void) }
            .result()
            .map_err(candle_core::Error::wrap)?;
        Ok(v)
    }

    fn set(p: sys::CUmemoryPool, a: sys::CUmemPool_attribute, mut v: u64) -> Result<()> {
        // SAFETY: as above.
        unsafe { sys::cuMemPoolSetAttribute(p, a, &mut v as *mut u64 as *mut std::ffi::c_void) }
            .result()
            .map_err(candle_core::Error::wrap)
    }

    pub(crate) fn keep_pool_memory(dev: &Device) -> Result<()> {
        if let Some(p) = pool(dev)? {
            set(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                u64::MAX,
            )?;
        }
        Ok(())
    }

    pub(crate) fn stats(dev: &Device) -> Result<Option<PoolStats>> {
        let Some(p) = pool(dev)? else { return Ok(None) };
        use sys::CUmemPool_attribute::*;
        Ok(Some(PoolStats {
            used: attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: attr(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved_high: attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        }))
    }

    pub(crate) fn reset_peak(dev: &Device) -> Result<()> {
        if let Some(p) = pool(dev)? {
            use sys::CUmemPool_attribute::*;
            set(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
            set(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        }
        Ok(())
    }

    fn bind(dev: &Device) -> Result<bool> {
        let Device::Cuda(cuda) = dev else {
            return Ok(false);
        };
        cuda.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
        Ok(true)
    }

    /// (free, total) bytes of the device (cuMemGetInfo).
    pub(crate) fn mem_info(dev: &Device) -> Result<Option<(u64, u64)>> {
        if !bind(dev)? {
            return Ok(None);
        }
        let (free, total) = candle_core::cuda::cudarc::driver::result::mem_get_info()
            .map_err(candle_core::Error::wrap)?;
        Ok(Some((free as u64, total as u64)))
    }

    /// A cuMemAlloc block outside the pool, freed on drop.
    pub(crate) struct Raw(sys::CUdeviceptr, Device);

    impl Drop for Raw {
        fn drop(&mut self) {
            if bind(&self.1).unwrap_or(false) {
                // SAFETY: the pointer came from malloc_sync below and is freed once.
                let _ = unsafe { candle_core::cuda::cudarc::driver::result::free_sync(self.0) };
            }
        }
    }

    pub(crate) fn alloc_raw(dev: &Device, bytes: u64) -> Result<Option<Raw>> {
        if !bind(dev)? {
            return Ok(None);
        }
        // SAFETY: plain device allocation in the bound context; freed by Raw's Drop.
        let ptr = unsafe { candle_core::cuda::cudarc::driver::result::malloc_sync(bytes as usize) }
            .map_err(candle_core::Error::wrap)?;
        Ok(Some(Raw(ptr, dev.clone())))
    }

    /// The chain holds cudarc's CUDA_ERROR_OUT_OF_MEMORY.
    pub(crate) fn is_driver_oom(e: &(dyn std::error::Error + 'static)) -> bool {
        use candle_core::cuda::cudarc::driver::DriverError;
        e.downcast_ref::<DriverError>()
            .is_some_and(|d| d.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::PoolStats;
    use candle_core::{Device, Result};
    pub(crate) fn keep_pool_memory(_: &Device) -> Result<()> {
        Ok(())
    }
    pub(crate) fn stats(_: &Device) -> Result<Option<PoolStats>> {
        Ok(None)
    }
    pub(crate) fn reset_peak(_: &Device) -> Result<()> {
        Ok(())
    }
    pub(crate) fn mem_info(_: &Device) -> Result<Option<(u64, u64)>> {
        Ok(None)
    }
    pub(crate) struct Raw;
    pub(crate) fn alloc_raw(_: &Device, _: u64) -> Result<Option<Raw>> {
        Ok(None)
    }
    pub(crate) fn is_driver_oom(_: &(dyn std::error::Error + 'static)) -> bool {
        false
    }
}

pub(crate) use imp::{alloc_raw, Raw};

/// Keep freed device memory in the pool for reuse (no-op on the CPU).
pub(crate) fn keep_pool_memory(dev: &Device) -> Result<()> {
    imp::keep_pool_memory(dev)
}

/// The pool's current and peak use (None on the CPU).
pub(crate) fn stats(dev: &Device) -> Result<Option<PoolStats>> {
    imp::stats(dev)
}

/// Restart the peak counters (no-op on the CPU).
pub(crate) fn reset_peak(dev: &Device) -> Result<()> {
    imp::reset_peak(dev)
}

/// (free, total) bytes of a CUDA device (None on the CPU).
pub(crate) fn mem_info(dev: &Device) -> Result<Option<(u64, u64)>> {
    imp::mem_info(dev)
}

/// A device allocation failed: the chain of `e` holds cudarc's CUDA_ERROR_OUT_OF_MEMORY, our
/// CPU accounting's `CpuOutOfMemory`, or an "out of memory" message (candle wraps some CUDA
/// errors as text).
pub(crate) fn is_oom(e: &anyhow::Error) -> bool {
    e.chain().any(is_oom_error)
}

fn is_oom_error(e: &(dyn std::error::Error + 'static)) -> bool {
    if imp::is_driver_oom(e) || e.downcast_ref::<CpuOutOfMemory>().is_some() {
        return true;
    }
    if let Some(c) = e.downcast_ref::<candle_core::Error>() {
        if candle_oom(c) {
            return true;
        }
    }
    oom_text(&e.to_string())
}

/// Through candle's wrappers to the CUDA error inside.
fn candle_oom(e: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    match e {
        E::Cuda(inner) => is_oom_error(inner.as_ref()),
        E::Context { inner, .. } | E::WithPath { inner, .. } | E::WithBacktrace { inner, .. } => {
            candle_oom(inner)
        }
        E::WrappedContext { wrapped, .. } => is_oom_error(wrapped.as_ref()),
        other => oom_text(&other.to_string()),
    }
}

fn oom_text(text: &str) -> bool {
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.to_ascii_lowercase().contains("out of memory")
}

/// The CPU accounting's cap was crossed (see `account_cpu`).
#[derive(Debug, thiserror::Error)]
#[error("out of memory (CPU accounting): the tensors the driver holds need {needed} bytes in {phase}, over train.max_memory = {cap} bytes")]
pub(crate) struct CpuOutOfMemory {
    pub(crate) needed: u64,
    pub(crate) cap: u64,
    pub(crate) phase: &'static str,
}

// The CPU accounting (`train.max_memory` on the CPU, where there is no device to fill): the
// bytes of the model and optimiser state (`set_cpu_budget`) plus what the driver holds at
// each layer (`account_cpu`). Not the process RSS: a count of real tensor bytes, so a run on
// the CPU can take the same out-of-memory path as a CUDA run.
// Per thread: one rank's training loop runs on one thread.
thread_local! {
    static CPU_CAP: Cell<u64> = const { Cell::new(u64::MAX) };
    static CPU_FIXED: Cell<u64> = const { Cell::new(0) };
    static CPU_HIGH: Cell<u64> = const { Cell::new(0) };
}

/// Sets the CPU cap (None: no cap) and the bytes held outside the driver (weights, adapters,
/// optimiser state).
pub(crate) fn set_cpu_budget(cap: Option<u64>, fixed: u64) {
    CPU_CAP.set(cap.unwrap_or(u64::MAX));
    CPU_FIXED.set(fixed);
    CPU_HIGH.set(fixed);
}

/// The driver holds `held` bytes of tensors in `phase`: an error when, with the fixed part,
/// that crosses the CPU cap. Free when no cap is set; never fails on CUDA.
pub(crate) fn account_cpu(dev: &Device, held: u64, phase: &'static str) -> Result<()> {
    let cap = CPU_CAP.get();
    if cap == u64::MAX || !dev.is_cpu() {
        return Ok(());
    }
    let needed = CPU_FIXED.get() + held;
    CPU_HIGH.set(CPU_HIGH.get().max(needed));
    if needed > cap {
        return Err(candle_core::Error::wrap(CpuOutOfMemory {
            needed,
            cap,
            phase,
        }));
    }
    Ok(())
}

/// The CPU accounting's high-water mark since `set_cpu_budget` (None without a cap).
pub(crate) fn cpu_high() -> Option<u64> {
    (CPU_CAP.get() != u64::MAX).then(|| CPU_HIGH.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_is_found_in_an_error_chain() {
        // CPU accounting, wrapped by candle, then given context by anyhow.
        let e = candle_core::Error::wrap(CpuOutOfMemory {
            needed: 10,
            cap: 5,
            phase: "forward",
        });
        let e = anyhow::Error::from(e).context("step 3");
        assert!(is_oom(&e));
        // candle's CUDA wrapper around a driver error text, nested in a Context.
        let inner: Box<dyn std::error::Error + Send + Sync> =
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into();
        let e = candle_core::Error::Cuda(inner).context("matmul");
        assert!(is_oom(&anyhow::Error::from(e)));
        // Other failures are not OOMs.
        let e = anyhow::Error::from(candle_core::Error::Msg("shape mismatch in matmul".into()));
        assert!(!is_oom(&e));
        let e = anyhow::anyhow!("CUDA_ERROR_ILLEGAL_ADDRESS").context("step 1");
        assert!(!is_oom(&e));
    }

    #[test]
    fn cpu_accounting_trips_over_the_cap_only() {
        let dev = Device::Cpu;
        set_cpu_budget(None, 100);
        assert!(account_cpu(&dev, 1 << 40, "forward").is_ok());
        set_cpu_budget(Some(1000), 100);
        assert!(account_cpu(&dev, 900, "forward").is_ok());
        let e = account_cpu(&dev, 901, "backward").unwrap_err();
        assert!(e.to_string().contains("need 1001 bytes in backward"), "{e}");
        assert_eq!(cpu_high(), Some(1001));
        set_cpu_budget(None, 0);
    }
}
