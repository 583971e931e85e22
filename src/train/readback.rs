//! A step's few scalars (its Σ CE, ‖g‖, the finite check) read on the host without draining the
//! device's queue.
//!
//! `to_vec1` on a CUDA tensor copies on the compute stream and then waits for that stream: for
//! everything queued before the copy, not only for the work that made the value. The loop reads
//! step k's loss once step k+1's forward and backward are queued, so such a read waited for all
//! of step k+1's backward; the device then idled while the host queued the update and the next
//! step's first kernels. Here the copy goes into pinned host memory as soon as the value is
//! made (`Readbacks::start`, queued right after it), and the read (`Readbacks::read`) waits for
//! that copy's event alone, which by then has long passed: the queue never runs dry.
//!
//! Off CUDA the tensor is kept and read by `read` (a copy there waits for nothing).

use candle_core::{DType, Result, Tensor};

/// Values at most a start carries.
const MAX: usize = 8;

/// A read on its way: the values land when the device has run the work before its copy.
pub struct Ticket(Slot);

enum Slot {
    /// The values [n] f64, read by `read` with `to_vec1`.
    Later(Tensor),
    /// On CUDA: the pinned buffer [n] the copy writes, and the event recorded after the copy.
    #[cfg(feature = "cuda")]
    Pinned(Pinned),
}

/// A pinned buffer and its own event. cudarc records a pinned slice's event only while its
/// context runs several streams with event tracking on; with one stream (no parked
/// activations) `as_slice` would then wait for nothing and read the previous copy's values.
#[cfg(feature = "cuda")]
struct Pinned {
    buf: candle_core::cuda::cudarc::driver::PinnedHostSlice<f64>,
    copied: candle_core::cuda::cudarc::driver::CudaEvent,
}

/// Pinned buffers for `Ticket`s, reused from step to step: page-locking host memory is a
/// driver call too slow (and freeing it too synchronous) to make per step.
#[derive(Default)]
pub struct Readbacks {
    #[cfg(feature = "cuda")]
    free: Vec<Pinned>,
}

impl Readbacks {
    /// No buffers yet: each is pinned at its first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues the copy of `parts` (scalars or short vectors of any float dtype, on one device;
    /// at most `MAX` values in all) to the host, as f64 in their order.
    pub fn start(&mut self, parts: &[&Tensor]) -> Result<Ticket> {
        let flat = parts
            .iter()
            .map(|t| t.to_dtype(DType::F64)?.flatten_all())
            .collect::<Result<Vec<_>>>()?;
        let x = Tensor::cat(&flat, 0)?.contiguous()?; // [n] f64
        let n = x.elem_count();
        if n > MAX {
            candle_core::bail!("readback: {n} values, at most {MAX}");
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            return self.start_cuda(dev, &x, n);
        }
        Ok(Ticket(Slot::Later(x)))
    }

    /// The values `start` queued: waits for their copy only (not for later work).
    pub fn read(&mut self, t: Ticket) -> Result<Vec<f64>> {
        match t.0 {
            Slot::Later(x) => x.to_vec1::<f64>(),
            #[cfg(feature = "cuda")]
            Slot::Pinned(p) => {
                let err = |e| candle_core::Error::msg(format!("readback: {e:?}"));
                p.copied.synchronize().map_err(err)?;
                let v = p.buf.as_slice().map_err(err)?.to_vec();
                self.free.push(p);
                Ok(v)
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn start_cuda(
        &mut self,
        dev: &candle_core::CudaDevice,
        x: &Tensor,
        n: usize,
    ) -> Result<Ticket> {
        use candle_core::cuda::WrapErr;
        use candle_core::Storage;
        let stream = dev.cuda_stream();
        // A buffer of exactly n: the copy fills the whole of it (a step's n stays the same).
        let mut p = match self.free.iter().position(|p| p.buf.len() == n) {
            Some(i) => self.free.swap_remove(i),
            None => Pinned {
                // SAFETY: the buffer is read only after the copy below wrote it (`read`).
                buf: unsafe { stream.context().alloc_pinned_with_flags::<f64>(n, 0) }.w()?,
                copied: stream.context().new_event(None).w()?,
            },
        };
        let (st, l) = x.storage_and_layout();
        let Storage::Cuda(cs) = &*st else {
            candle_core::bail!("readback: the values are not on the GPU")
        };
        let o = l.start_offset();
        let src = cs.as_cuda_slice::<f64>()?.slice(o..o + n);
        // Queued on the compute stream after the work that made x, then the event `read` waits
        // for. x's free, queued after it on the same stream, cannot overtake it.
        stream.memcpy_dtoh(&src, &mut p.buf).w()?;
        p.copied.record(&stream).w()?;
        Ok(Ticket(Slot::Pinned(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Parts of several dtypes and shapes come back as f64 in order; too many values is an
    /// error, not a short read.
    #[test]
    fn reads_parts_in_order_as_f64() {
        let dev = Device::Cpu;
        let a = Tensor::new(2.5f32, &dev).unwrap();
        let b = Tensor::new(&[1.0f64, -3.0], &dev).unwrap();
        let c = Tensor::new(&[7.0f32], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let mut r = Readbacks::new();
        let t = r.start(&[&a, &b, &c]).unwrap();
        assert_eq!(r.read(t).unwrap(), vec![2.5, 1.0, -3.0, 7.0]);
        let big = Tensor::zeros(MAX + 1, DType::F32, &dev).unwrap();
        assert!(r.start(&[&big]).is_err());
    }
}
