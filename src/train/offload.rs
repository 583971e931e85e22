//! Activation offload: each decoder layer's residual h = x + o_proj(attn) [m, C] waits for its
//! backward in pinned host memory instead of the GPU's.
//!
//! Backward needs h (post_norm's backward and gate's and up's adapter gradients). Without it
//! backward recomputes h with o_proj's GEMM, one of the layer's seven; kept on the device it
//! costs one [m, C] tensor per layer (1 GiB over 32 layers at micro-batch 2 × 2048 at 7B).
//! Parked on the host it costs neither: the copies run on a stream of their own, on the copy
//! engines over PCIe (32 MiB a layer at 7B, well under the time of a layer's forward or
//! backward), while the SMs run the layers.
//!
//! - forward: layer l's h goes out when the layer is done (the side stream first waits for
//!   the compute queued so far). The device tensor lives on until the next h goes out; its free
//!   then waits for its copy (an event long passed): two h on the device at most. The last
//!   layer's h is not parked: its backward comes first, right after the head.
//! - backward: layer l's h comes back into a fresh device tensor while layer l + 1 runs
//!   backward (`fetch`, issued just before it), and the compute waits for that copy just
//!   before layer l's backward (`take`).
//! - host buffers: one per layer, pinned, kept per device for the process. Micro-batches and
//!   steps reuse them in stream order: all copies of a device run on its one side stream, so a
//!   layer's copy out of the next micro-batch follows its copy back of this one.
//!
//! Off CUDA (tests) h is parked as a deep copy on its own device, through the same calls.

use candle_core::{Device, Result, Tensor};

/// Parks the residuals of one micro-batch's layers (`put`), and brings them back (`fetch`,
/// then `take`).
pub struct Offload {
    imp: Imp,
}

enum Imp {
    /// Off CUDA: deep copies.
    Copy(Vec<Option<Tensor>>),
    #[cfg(feature = "cuda")]
    Cuda(gpu::Parking),
}

impl Offload {
    /// For a micro-batch of `layers` layers on `dev`.
    pub fn new(dev: &Device, layers: usize) -> Result<Offload> {
        let imp = match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Imp::Cuda(gpu::Parking::new(d, layers)?),
            _ => Imp::Copy(vec![None; layers]),
        };
        Ok(Offload { imp })
    }

    /// Parks layer `l`'s h [m, C] (contiguous, bf16, f16 or f32).
    pub fn put(&mut self, l: usize, h: Tensor) -> Result<()> {
        match &mut self.imp {
            Imp::Copy(slots) => {
                let slot = slot(slots, l)?;
                *slot = Some(h.copy()?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Imp::Cuda(p) => p.put(l, h),
        }
    }

    /// Starts bringing layer `l`'s h back (call it a layer ahead of `take`).
    pub fn fetch(&mut self, l: usize) -> Result<()> {
        match &mut self.imp {
            Imp::Copy(slots) => slot(slots, l).map(|_| ()),
            #[cfg(feature = "cuda")]
            Imp::Cuda(p) => p.fetch(l),
        }
    }

    /// Layer `l`'s h, as `put` got it.
    pub fn take(&mut self, l: usize) -> Result<Tensor> {
        match &mut self.imp {
            Imp::Copy(slots) => match slot(slots, l)?.take() {
                Some(h) => Ok(h),
                None => candle_core::bail!("offload: layer {l}'s residual was not parked"),
            },
            #[cfg(feature = "cuda")]
            Imp::Cuda(p) => p.take(l),
        }
    }
}

fn slot<T>(slots: &mut [T], l: usize) -> Result<&mut T> {
    let n = slots.len();
    match slots.get_mut(l) {
        Some(s) => Ok(s),
        None => candle_core::bail!("offload: layer {l} of {n}"),
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::slot;
    use crate::ops::cuda::{addr, uninit};
    use candle_core::cuda::cudarc::driver::{result, sys, CudaEvent, CudaStream};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, DType, Result, Shape, Tensor};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    /// Page-locked host memory (cuMemHostAlloc), freed on drop.
    struct Pinned {
        ptr: *mut u8,
        bytes: usize,
    }

    // SAFETY: a plain host allocation, owned; only its owner's thread queues copies with it.
    unsafe impl Send for Pinned {}

    impl Drop for Pinned {
        fn drop(&mut self) {
            // SAFETY: `ptr` came from malloc_host, and no copy is pending (see `Host`).
            let _ = unsafe { result::free_host(self.ptr as _) };
        }
    }

    /// A device's side stream and host buffers, kept for the process. A buffer is freed only
    /// after the side stream is synchronised, so never under a pending copy.
    struct Host {
        side: Arc<CudaStream>,
        bufs: Vec<Option<Pinned>>,
    }

    /// Per device ordinal; taken out while a micro-batch uses it (one rank per device).
    static HOSTS: OnceLock<Mutex<HashMap<usize, Host>>> = OnceLock::new();

    fn hosts() -> std::sync::MutexGuard<'static, HashMap<usize, Host>> {
        HOSTS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub struct Parking {
        dev: CudaDevice,
        ordinal: usize,
        host: Option<Host>,
        /// The last h parked, alive until its copy out is done.
        out: Option<(Tensor, CudaEvent)>,
        /// Per layer: what was parked (shape, dtype).
        parked: Vec<Option<(Shape, DType)>>,
        /// Per layer: the h on its way back.
        back: Vec<Option<(Tensor, CudaEvent)>>,
    }

    impl Parking {
        pub fn new(dev: &CudaDevice, layers: usize) -> Result<Parking> {
            let ordinal = dev.cuda_stream().context().ordinal();
            let host = match hosts().remove(&ordinal) {
                Some(h) => h,
                None => Host {
                    side: dev.cuda_stream().context().new_stream().w()?,
                    bufs: Vec::new(),
                },
            };
            Ok(Parking {
                dev: dev.clone(),
                ordinal,
                host: Some(host),
                out: None,
                parked: vec![None; layers],
                back: (0..layers).map(|_| None).collect(),
            })
        }

        fn host(&mut self) -> Result<&mut Host> {
            match &mut self.host {
                Some(h) => Ok(h),
                None => candle_core::bail!("offload: no host buffers"),
            }
        }

        /// Layer `l`'s host buffer, at least `bytes` long.
        fn buffer(&mut self, l: usize, bytes: usize) -> Result<*mut u8> {
            let ctx = self.dev.cuda_stream().context().clone();
            let host = self.host()?;
            if host.bufs.len() <= l {
                host.bufs.resize_with(l + 1, || None);
            }
            if host.bufs[l].as_ref().is_none_or(|b| b.bytes < bytes) {
                // The old buffer may still be read by a copy of an earlier micro-batch.
                host.side.synchronize().w()?;
                host.bufs[l] = None;
                ctx.bind_to_thread().w()?;
                // SAFETY: a fresh page-locked allocation of `bytes`, owned by `Pinned`.
                let ptr = match unsafe { result::malloc_host(bytes, 0) } {
                    Ok(p) => p as *mut u8,
                    Err(e) => candle_core::bail!(
                        "activation offload: cannot pin {bytes} bytes of host memory for layer \
                         {l} ({e:?}); free host memory, or set train.offload_activations = false \
                         (bench: --offload false) to recompute the residuals instead"
                    ),
                };
                host.bufs[l] = Some(Pinned { ptr, bytes });
            }
            match &host.bufs[l] {
                Some(b) => Ok(b.ptr),
                None => candle_core::bail!("offload: no buffer for layer {l}"),
            }
        }

        pub fn put(&mut self, l: usize, h: Tensor) -> Result<()> {
            let bytes = h.elem_count() * h.dtype().size_in_bytes();
            let Some(src) = addr(&h)? else {
                candle_core::bail!("offload: h is not a contiguous float CUDA tensor");
            };
            let dst = self.buffer(l, bytes)?;
            let compute = self.dev.cuda_stream();
            let side = self.host()?.side.clone();
            side.join(&compute).w()?; // h is written
                                      // SAFETY: `dst` holds ≥ `bytes` (buffer), pinned and kept until the side stream is
                                      // synchronised; `src` is h's `bytes`, alive until the copy's event is waited for.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(dst, bytes);
                result::memcpy_dtoh_async(dst, src, side.cu_stream()).w()?;
            }
            let done = side
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .w()?;
            *slot(&mut self.parked, l)? = Some((h.shape().clone(), h.dtype()));
            self.release_out()?;
            self.out = Some((h, done));
            Ok(())
        }

        /// Frees the last parked h once its copy is done (its free is queued on the compute
        /// stream, so the compute waits for the copy first: a pool reuse must not race it).
        fn release_out(&mut self) -> Result<()> {
            if let Some((h, done)) = self.out.take() {
                self.dev.cuda_stream().wait(&done).w()?;
                drop(h);
            }
            Ok(())
        }

        pub fn fetch(&mut self, l: usize) -> Result<()> {
            self.release_out()?;
            let Some((shape, dtype)) = slot(&mut self.parked, l)?.take() else {
                candle_core::bail!("offload: layer {l}'s residual was not parked");
            };
            let bytes = shape.elem_count() * dtype.size_in_bytes();
            let src = self.buffer(l, bytes)?;
            // SAFETY: every element is written by the copy below before the compute, which
            // waits for it in `take`, reads any.
            let Some(h) = (unsafe { uninit(&self.dev, dtype, shape) })? else {
                candle_core::bail!("offload: dtype {dtype:?}");
            };
            let Some(dst) = addr(&h)? else {
                candle_core::bail!("offload: a fresh tensor without an address");
            };
            let compute = self.dev.cuda_stream();
            let side = self.host()?.side.clone();
            // h's allocation (stream-ordered, on the compute stream) comes first
            side.join(&compute).w()?;
            // SAFETY: `src` holds the `bytes` parked by `put` (pinned, kept); `dst` is h's
            // `bytes`, alive in `back` until the compute waited for the copy.
            unsafe {
                let src = std::slice::from_raw_parts(src as *const u8, bytes);
                result::memcpy_htod_async(dst, src, side.cu_stream()).w()?;
            }
            let done = side
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .w()?;
            *slot(&mut self.back, l)? = Some((h, done));
            Ok(())
        }

        pub fn take(&mut self, l: usize) -> Result<Tensor> {
            if slot(&mut self.back, l)?.is_none() {
                self.fetch(l)?;
            }
            let Some((h, done)) = slot(&mut self.back, l)?.take() else {
                candle_core::bail!("offload: layer {l}'s residual did not come back");
            };
            self.dev.cuda_stream().wait(&done).w()?;
            Ok(h)
        }
    }

    impl Drop for Parking {
        fn drop(&mut self) {
            let Some(host) = self.host.take() else {
                return;
            };
            // Tensors still in flight (a micro-batch that ended early, or an error) are freed
            // on the compute stream: the copies must be done first. At a normal end every
            // copy has been waited for, and this returns at once.
            let _ = host.side.synchronize();
            self.out = None;
            self.back.clear();
            hosts().insert(self.ordinal, host);
        }
    }
}
