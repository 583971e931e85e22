//! The buffers an NF4 layer is dequantized into on CUDA: a few layer-sized slabs made once and
//! reused, so the step's stream of dequantized layers (the next one made ahead of use, as FSDP
//! gathers) does not allocate and free ~0.4 GB per layer, interleaved with the activations the
//! forward keeps, which fragments the pool.
//!
//! A slab is free when no layer holds its lease (the `Arc` the resident layer keeps, dropped with
//! it and its clones). The work that reads a slab is queued on the one compute stream before the
//! work that rewrites it, so stream order keeps a reused slab's old readers correct.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::{Arc, Mutex};

/// Slabs kept: the running layer, the next one made ahead, and one for a caller that holds a
/// third (beyond it, layers get fresh buffers).
#[cfg(feature = "cuda")]
const MAX: usize = 3;

/// A model's dequantizing slabs (CUDA builds only hand them out).
#[derive(Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Slabs(Mutex<Vec<(Tensor, Arc<()>)>>);

impl Slabs {
    /// A buffer [≥ elems] of `dtype` on CUDA `device` that no live layer holds, with its lease;
    /// None off CUDA, or when every slab is held and no more are kept.
    pub(crate) fn take(
        &self,
        elems: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<(Tensor, Arc<()>)>> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (elems, dtype, device);
            Ok(None)
        }
        #[cfg(feature = "cuda")]
        self.take_cuda(elems, dtype, device)
    }

    #[cfg(feature = "cuda")]
    fn take_cuda(
        &self,
        elems: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<(Tensor, Arc<()>)>> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let mut slabs = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("nf4: the slab pool was poisoned".into()))?;
        let free = |(t, lease): &(Tensor, Arc<()>)| {
            Arc::strong_count(lease) == 1 && t.dtype() == dtype && t.elem_count() >= elems
        };
        if let Some((t, lease)) = slabs.iter().find(|s| free(s)) {
            return Ok(Some((t.clone(), lease.clone())));
        }
        if slabs.len() >= MAX {
            return Ok(None);
        }
        // SAFETY: a slab's elements are written (dequantized) before a layer reads them.
        let Some(t) = (unsafe { crate::ops::cuda::uninit(dev, dtype, elems)? }) else {
            return Ok(None);
        };
        let lease = Arc::new(());
        slabs.push((t.clone(), lease.clone()));
        Ok(Some((t, lease)))
    }
}
