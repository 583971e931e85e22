//! A checkpoint's tensors copied to host memory without stopping the loop.
//!
//! A save copies the adapters and AdamW's m and v (Llama-2-7B, r16 on all linears: 480 MB of
//! f32). A plain `to_device(Cpu)` copies each into fresh pageable memory and waits for the
//! stream, and for the page faults of memory touched the first time. Here each tensor is
//! copied into a page-locked buffer kept for the run, queued on the compute stream behind the
//! step that made the values and ahead of the next update (which writes them in place), with
//! an event recorded after the copies. The writer thread waits for that event
//! (`HostTensors::write`) and streams the buffer into the file; the loop waits for nothing.
//!
//! Off CUDA the tensors are copied at once (a host copy waits for nothing).

use candle_core::{Result, Shape, Tensor};

/// The pinned buffers of a run's saves, reused from save to save (page-locking is a driver
/// call that touches every page, and freeing it waits for the device).
#[derive(Default)]
pub struct Stage {
    #[cfg(feature = "cuda")]
    pool: std::sync::Arc<std::sync::Mutex<Vec<cuda::Pinned>>>,
}

/// Named tensors on their way to host memory.
pub struct HostTensors {
    parts: Vec<(String, Shape)>,
    data: Data,
}

enum Data {
    /// Host tensors of their own, in `parts`' order.
    Ready(Vec<Tensor>),
    /// Copies queued into one pinned buffer, `parts` one after the other.
    #[cfg(feature = "cuda")]
    Staged(cuda::Staged),
}

impl Stage {
    /// An empty stage.
    pub fn new() -> Stage {
        Stage::default()
    }

    /// Pins a buffer of each of `lens` f32 now, on CUDA (elsewhere nothing).
    pub(crate) fn reserve(&self, dev: &candle_core::Device, lens: &[usize]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = dev {
            let mut new = lens
                .iter()
                .map(|&n| cuda::pin(dev, n))
                .collect::<Result<Vec<_>>>()?;
            cuda::lock(&self.pool)?.append(&mut new);
        }
        let _ = (dev, lens);
        Ok(())
    }

    /// Starts copying `parts` (float tensors, on one device) to host memory as f32.
    pub fn copy(&self, parts: Vec<(String, Tensor)>) -> Result<HostTensors> {
        #[cfg(feature = "cuda")]
        if let Some((_, t)) = parts.first() {
            if let candle_core::Device::Cuda(dev) = t.device() {
                let dev = dev.clone();
                return cuda::stage(&self.pool, &dev, parts);
            }
        }
        let mut names = Vec::with_capacity(parts.len());
        let mut host = Vec::with_capacity(parts.len());
        for (name, t) in parts {
            names.push((name, t.shape().clone()));
            let t = t.to_dtype(candle_core::DType::F32)?;
            host.push(crate::export::host_copy(&t)?);
        }
        Ok(HostTensors {
            parts: names,
            data: Data::Ready(host),
        })
    }
}

impl HostTensors {
    /// The tensors on the host, once their copies have landed (waits for those copies only).
    pub fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.data {
            Data::Ready(host) => Ok(self.names().zip(host.iter().cloned()).collect()),
            #[cfg(feature = "cuda")]
            Data::Staged(s) => self
                .slices(s.landed()?)?
                .into_iter()
                .map(|(name, shape, xs)| {
                    let t = Tensor::from_slice(xs, shape, &candle_core::Device::Cpu)?;
                    Ok((name.to_string(), t))
                })
                .collect(),
        }
    }

    /// The tensors as one safetensors file at `path` (`export::write_tensors`' bytes), written
    /// from the host buffer itself once the copies have landed.
    pub fn write(&self, path: &std::path::Path) -> anyhow::Result<()> {
        match &self.data {
            Data::Ready(host) => {
                let named: Vec<_> = self.names().zip(host.iter().cloned()).collect();
                crate::export::write_tensors(path, &named)
            }
            #[cfg(feature = "cuda")]
            Data::Staged(s) => crate::export::write_f32(path, &self.slices(s.landed()?)?),
        }
    }

    fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.parts.iter().map(|(n, _)| n.clone())
    }

    /// `parts` over `all`, one after the other: (name, dims, values).
    #[cfg(feature = "cuda")]
    fn slices<'a>(&'a self, all: &'a [f32]) -> Result<Vec<crate::export::F32Part<'a>>> {
        let mut out = Vec::with_capacity(self.parts.len());
        let mut at = 0;
        for (name, shape) in &self.parts {
            let n = shape.elem_count();
            let Some(xs) = all.get(at..at + n) else {
                candle_core::bail!("host stage: {name} runs past the buffer");
            };
            out.push((name.as_str(), shape.dims(), xs));
            at += n;
        }
        Ok(out)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Data, HostTensors};
    use crate::ops::cuda::addr;
    use candle_core::cuda::cudarc::driver::{result, CudaEvent, PinnedHostSlice};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, DType, Result, Tensor};
    use std::sync::{Arc, Mutex};

    /// A page-locked buffer and the event recorded after the copies into it.
    pub(crate) struct Pinned {
        buf: PinnedHostSlice<f32>,
        copied: CudaEvent,
    }

    /// One save's buffer; it goes back to the pool when dropped (the write is done).
    pub(crate) struct Staged {
        pinned: Option<Pinned>,
        pool: Arc<Mutex<Vec<Pinned>>>,
        /// The f32 sources (the model's own tensors, or copies made of other dtypes), alive
        /// until the copies out of them have run.
        _sources: Vec<Tensor>,
    }

    type Pool = Arc<Mutex<Vec<Pinned>>>;

    pub(crate) fn stage(
        pool: &Pool,
        dev: &CudaDevice,
        parts: Vec<(String, Tensor)>,
    ) -> Result<HostTensors> {
        let n: usize = parts.iter().map(|(_, t)| t.elem_count()).sum();
        let mut p = take(pool, dev, n)?;
        let stream = dev.cuda_stream();
        let dst = p.buf.as_mut_slice().w()?;
        let (mut names, mut sources, mut at) = (Vec::new(), Vec::new(), 0);
        for (name, t) in parts {
            let n = t.elem_count();
            let f = match t.dtype() {
                DType::F32 => t.clone(),
                _ => t.to_dtype(DType::F32)?,
            };
            let f = f.contiguous()?;
            let Some(src) = addr(&f)? else {
                candle_core::bail!("host stage: {name} is not a CUDA tensor");
            };
            // SAFETY: dst[at..at + n] lies in the pinned buffer (n elements were counted
            // above), which is read only after `copied` (recorded below) has passed; `src`
            // is f's n f32, kept in `sources` until then.
            unsafe { result::memcpy_dtoh_async(&mut dst[at..at + n], src, stream.cu_stream()) }
                .w()?;
            names.push((name, t.shape().clone()));
            sources.push(f);
            at += n;
        }
        p.copied.record(&stream).w()?;
        Ok(HostTensors {
            parts: names,
            data: Data::Staged(Staged {
                pinned: Some(p),
                pool: pool.clone(),
                _sources: sources,
            }),
        })
    }

    pub(crate) fn lock(pool: &Pool) -> Result<std::sync::MutexGuard<'_, Vec<Pinned>>> {
        pool.lock()
            .map_err(|_| candle_core::Error::msg("host stage: the pool's lock is poisoned"))
    }

    /// A free buffer of at least `n` f32 (the smallest), or a new one of exactly `n`.
    fn take(pool: &Pool, dev: &CudaDevice, n: usize) -> Result<Pinned> {
        let mut free = lock(pool)?;
        let best = (0..free.len())
            .filter(|&i| free[i].buf.len() >= n)
            .min_by_key(|&i| free[i].buf.len());
        match best {
            Some(i) => Ok(free.swap_remove(i)),
            None => pin(dev, n),
        }
    }

    /// A new page-locked buffer of `n` f32.
    pub(crate) fn pin(dev: &CudaDevice, n: usize) -> Result<Pinned> {
        let ctx = dev.cuda_stream().context().clone();
        // SAFETY: written by the copies `stage` queues before it is read (`landed`).
        let buf = match unsafe { ctx.alloc_pinned_with_flags::<f32>(n.max(1), 0) } {
            Ok(b) => b,
            Err(e) => candle_core::bail!(
                "checkpoint: cannot pin {} bytes of host memory for the adapters and the \
                 optimizer state ({e:?}); free host memory, or save less often \
                 (output.save_every)",
                4 * n
            ),
        };
        let copied = ctx.new_event(None).w()?;
        Ok(Pinned { buf, copied })
    }

    impl Staged {
        /// The buffer's values once the copies into it have run.
        pub(crate) fn landed(&self) -> Result<&[f32]> {
            let Some(p) = &self.pinned else {
                candle_core::bail!("host stage: the buffer was returned");
            };
            p.copied.synchronize().w()?;
            p.buf.as_slice().w()
        }
    }

    impl Drop for Staged {
        fn drop(&mut self) {
            // A buffer whose copies may still run (an error before `landed`) waits for them.
            if let Some(p) = self.pinned.take() {
                if p.copied.synchronize().is_ok() {
                    if let Ok(mut free) = self.pool.lock() {
                        free.push(p);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Off CUDA the parts come back as f32 host tensors of their own, named and shaped as
    /// given, in order: a later in-place change of the source does not reach them.
    #[test]
    fn parts_come_back_as_f32_copies_in_order() {
        let dev = Device::Cpu;
        let a = candle_core::Var::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let b = Tensor::new(&[5.0f32, 6.0, 7.0], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let staged = Stage::new()
            .copy(vec![("a".into(), a.as_tensor().clone()), ("b".into(), b)])
            .unwrap();
        a.set(&a.zeros_like().unwrap()).unwrap();
        let got = staged.tensors().unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, "a");
        assert_eq!(got[0].1.to_vec2::<f32>().unwrap(), [[1.0, 2.0], [3.0, 4.0]]);
        assert_eq!((got[1].0.as_str(), got[1].1.dtype()), ("b", DType::F32));
        assert_eq!(got[1].1.to_vec1::<f32>().unwrap(), [5.0, 6.0, 7.0]);
    }
}
