//! Device memory truth: the CUDA memory pool's high-water marks.
//!
//! candle allocates with cuMemAllocAsync from the device's default pool. We keep the pool's
//! memory (release threshold = max, so freed blocks are reused instead of returned to the
//! driver on every synchronisation) and read its peak use, which is what decides an OOM.

use candle_core::{Device, Result};

/// Bytes in use now and at the peak since the last reset (None on the CPU).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PoolStats {
    pub used: u64,
    pub used_high: u64,
    pub reserved_high: u64,
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

    pub fn keep_pool_memory(dev: &Device) -> Result<()> {
        if let Some(p) = pool(dev)? {
            set(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                u64::MAX,
            )?;
        }
        Ok(())
    }

    pub fn stats(dev: &Device) -> Result<Option<PoolStats>> {
        let Some(p) = pool(dev)? else { return Ok(None) };
        use sys::CUmemPool_attribute::*;
        Ok(Some(PoolStats {
            used: attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: attr(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved_high: attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        }))
    }

    pub fn reset_peak(dev: &Device) -> Result<()> {
        if let Some(p) = pool(dev)? {
            use sys::CUmemPool_attribute::*;
            set(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
            set(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        }
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::PoolStats;
    use candle_core::{Device, Result};
    pub fn keep_pool_memory(_: &Device) -> Result<()> {
        Ok(())
    }
    pub fn stats(_: &Device) -> Result<Option<PoolStats>> {
        Ok(None)
    }
    pub fn reset_peak(_: &Device) -> Result<()> {
        Ok(())
    }
}

/// Keep freed device memory in the pool for reuse (no-op on the CPU).
pub fn keep_pool_memory(dev: &Device) -> Result<()> {
    imp::keep_pool_memory(dev)
}

/// The pool's current and peak use (None on the CPU).
pub fn stats(dev: &Device) -> Result<Option<PoolStats>> {
    imp::stats(dev)
}

/// Restart the peak counters (no-op on the CPU).
pub fn reset_peak(dev: &Device) -> Result<()> {
    imp::reset_peak(dev)
}

pub const GIB: f64 = (1u64 << 30) as f64;
