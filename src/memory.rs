//! Device memory for a run: the plan (`plan/`), the host's memory (`host`), the ballast that
//! makes a card behave as one of `train.max_memory`, the GPUs' free memory. The pool's own
//! counters and the OOM test are the device's (`ops::pool`); the step's phase meter is the
//! trainer's (`train::meter`).

pub mod host;
pub mod plan;

use crate::ops::pool::{alloc_raw, mem_info, Raw};
use candle_core::{Device, Result};

/// `train.max_memory` on CUDA: a block taken with cuMemAlloc, outside the pool candle uses, so
/// that what the pool can still get is `max_memory` (the card behaves as one of that size;
/// OOMs are real). Dropping it gives the memory back.
pub(crate) struct Ballast {
    _raw: Option<Raw>,
    /// Bytes held (0: the card already had no more than max_memory free).
    pub(crate) bytes: u64,
    /// The device's total memory.
    pub(crate) total: u64,
}

impl Drop for Ballast {
    fn drop(&mut self) {
        // Gives the block back (Raw frees it on CUDA).
        self._raw.take();
    }
}

/// Holds `total − max_memory` bytes of the device (less when that much is not free: then
/// what is free is already within max_memory). None on the CPU.
pub(crate) fn hold_ballast(dev: &Device, max_memory: u64) -> Result<Option<Ballast>> {
    let Some((free, total)) = mem_info(dev)? else {
        return Ok(None);
    };
    let want = total.saturating_sub(max_memory);
    // Never leave the pool less than max_memory: take at most free − max_memory.
    let bytes = want.min(free.saturating_sub(max_memory));
    if bytes == 0 {
        return Ok(Some(Ballast {
            _raw: None,
            bytes: 0,
            total,
        }));
    }
    Ok(Some(Ballast {
        _raw: alloc_raw(dev, bytes)?,
        bytes,
        total,
    }))
}

/// The least free memory of the GPUs `ordinals` in a CUDA build that has them all, plus the
/// context this process took to ask (the plan counts a context); None otherwise.
pub fn free_gpu_memory(ordinals: &[usize]) -> Option<u64> {
    if !cfg!(feature = "cuda") {
        return None;
    }
    let mut least: Option<u64> = None;
    for &o in ordinals {
        let dev = candle_core::Device::new_cuda(o).ok()?;
        let (free, _) = mem_info(&dev).ok().flatten()?;
        least = Some(least.map_or(free, |l| l.min(free)));
    }
    least.map(|f| f + plan::CONTEXT)
}

/// The host memory free for this process now (`host::probe`'s `available`: MemAvailable
/// within its cgroup and address-space limits, or LORA_TRAIN_HOST_MEMORY); None where
/// nothing says.
pub(crate) fn host_available() -> Option<u64> {
    host::probe().ok().flatten().map(|h| h.available)
}

pub(crate) use host::host_fits;

/// The plan's row as the run's memory watch carries it: plain numbers and its label, for the
/// out-of-memory diagnosis and the parking the preflight fitted.
pub(crate) fn forecast(b: &plan::Breakdown) -> crate::train::meter::Forecast {
    crate::train::meter::Forecast {
        label: plan::label(b),
        micro_batch: b.micro_batch,
        total: b.total,
        pool_peak: b.pool_peak,
        peak_phase: b.peak_phase,
        base: b.base,
        activations: b.activations,
        transient: b.transient,
        park_pending: b.park_pending,
    }
}
