//! Activation offload: what a decoder layer's backward needs waits in pinned host memory
//! instead of the GPU's, as one bundle of tensors per layer:
//!
//! - without checkpointing, the residual h = x + o_proj(attn) [m, C]. Backward needs it
//!   (post_norm's backward and gate's and up's adapter gradients). Without it backward
//!   recomputes h with o_proj's GEMM, one of the layer's seven; kept on the device it costs one
//!   [m, C] tensor per layer (1 GiB over 32 layers at micro-batch 2 × 2048 at 7B).
//! - with the MLP half checkpointed (`activation_checkpointing = "mlp"`), gate and up [m, I]
//!   each: backward then skips the MLP's recompute (gate's and up's GEMMs, a quarter of a
//!   layer's FLOPs at Llama-3-8B) at the device memory of recomputing them (driver::Keep).
//! - with the whole layer checkpointed, the layer input x [m, C].
//!
//! The copies run on a stream of their own, on the copy engines over PCIe, while the SMs run
//! the layers (a PCIe 5 link moves ~54 GB/s each way: gate and up of a Llama-3-8B layer at
//! 2 × 4096 tokens, 448 MiB, in ~8.5 ms against the layer's ~7 ms forward and ~14 ms backward).
//!
//! - forward: layer l's bundle goes out when the layer is done (the side stream first waits
//!   for the compute queued so far). Its device tensors live on until their copy is done; up
//!   to `pending` bundles may wait so, and parking one more first makes the compute wait for
//!   the oldest copy (an event usually long passed), then frees it. The driver does not park
//!   the last layer's (its backward comes first, right after the head).
//! - backward: layer l's bundle comes back into fresh device tensors while layer l + 1 runs
//!   backward (`fetch`, issued just before it; the bundles still going out are freed first),
//!   and the compute waits for that copy just before layer l's backward (`take`).
//! - host buffers: one per layer, pinned, kept per device for the process. Micro-batches and
//!   steps reuse them in stream order: all copies of a device run on its one side stream, so a
//!   layer's copy out of the next micro-batch follows its copy back of this one.
//!
//! Off CUDA a bundle is parked as deep copies on its own device, through the same calls.

use candle_core::{Device, Result, Tensor};

/// Parks one micro-batch's per-layer bundles (`put`), and brings them back (`fetch`, then
/// `take`).
pub(crate) struct Offload {
    imp: Imp,
}

enum Imp {
    /// Off CUDA: deep copies.
    Copy(Vec<Option<Vec<Tensor>>>),
    #[cfg(feature = "cuda")]
    Cuda(gpu::Parking),
}

impl Offload {
    /// For a micro-batch of `layers` layers on `dev`, with up to `pending` bundles on the
    /// device while their copies out run (at least 1).
    pub(crate) fn new(dev: &Device, layers: usize, pending: usize) -> Result<Offload> {
        let imp = match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Imp::Cuda(gpu::Parking::new(d, layers, pending.max(1))?),
            _ => {
                let _ = pending;
                Imp::Copy(vec![None; layers])
            }
        };
        Ok(Offload { imp })
    }

    /// Parks layer `l`'s tensors (each contiguous, bf16, f16 or f32).
    pub(crate) fn put(&mut self, l: usize, bundle: Vec<Tensor>) -> Result<()> {
        match &mut self.imp {
            Imp::Copy(slots) => {
                let copies = bundle.iter().map(Tensor::copy).collect::<Result<_>>()?;
                *slot(slots, l)? = Some(copies);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Imp::Cuda(p) => p.put(l, bundle),
        }
    }

    /// Starts bringing layer `l`'s bundle back (call it a layer ahead of `take`).
    pub(crate) fn fetch(&mut self, l: usize) -> Result<()> {
        match &mut self.imp {
            Imp::Copy(slots) => slot(slots, l).map(|_| ()),
            #[cfg(feature = "cuda")]
            Imp::Cuda(p) => p.fetch(l),
        }
    }

    /// Layer `l`'s tensors, as `put` got them.
    pub(crate) fn take(&mut self, l: usize) -> Result<Vec<Tensor>> {
        match &mut self.imp {
            Imp::Copy(slots) => match slot(slots, l)?.take() {
                Some(b) => Ok(b),
                None => candle_core::bail!("offload: layer {l}'s activations were not parked"),
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
    use std::collections::{HashMap, VecDeque};
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

    /// Where one parked tensor lies in its layer's host buffer.
    struct Part {
        shape: Shape,
        dtype: DType,
        offset: usize,
        bytes: usize,
    }

    /// A bundle's tensors on the device and the event of their copy (out or back).
    type Flight = (Vec<Tensor>, CudaEvent);

    pub(crate) struct Parking {
        dev: CudaDevice,
        ordinal: usize,
        host: Option<Host>,
        /// The bundles parked last, alive until their copies out are done, oldest first.
        out: VecDeque<Flight>,
        /// At most this many in `out`.
        pending: usize,
        /// Per layer: what was parked.
        parked: Vec<Option<Vec<Part>>>,
        /// Per layer: the bundle on its way back.
        back: Vec<Option<Flight>>,
    }

    /// Each part's offset in a layer's buffer is a multiple of this (the copy engines' bursts).
    const ALIGN: usize = 256;

    impl Parking {
        pub(crate) fn new(dev: &CudaDevice, layers: usize, pending: usize) -> Result<Parking> {
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
                out: VecDeque::new(),
                pending,
                parked: (0..layers).map(|_| None).collect(),
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
                         (bench: --offload false) to recompute the activations instead"
                    ),
                };
                host.bufs[l] = Some(Pinned { ptr, bytes });
            }
            match &host.bufs[l] {
                Some(b) => Ok(b.ptr),
                None => candle_core::bail!("offload: no buffer for layer {l}"),
            }
        }

        pub(crate) fn put(&mut self, l: usize, bundle: Vec<Tensor>) -> Result<()> {
            let mut parts = Vec::with_capacity(bundle.len());
            let mut end = 0usize;
            for t in &bundle {
                let offset = end.next_multiple_of(ALIGN);
                let bytes = t.elem_count() * t.dtype().size_in_bytes();
                end = offset + bytes;
                let (shape, dtype) = (t.shape().clone(), t.dtype());
                parts.push(Part {
                    shape,
                    dtype,
                    offset,
                    bytes,
                });
            }
            let base = self.buffer(l, end)?;
            let compute = self.dev.cuda_stream();
            let side = self.host()?.side.clone();
            side.join(&compute).w()?; // the bundle is written
            for (t, part) in bundle.iter().zip(&parts) {
                let Some(src) = addr(t)? else {
                    candle_core::bail!("offload: a tensor that is not a contiguous float CUDA one");
                };
                // SAFETY: the buffer holds ≥ `end` bytes (`buffer`), pinned and kept until the
                // side stream is synchronised, and the parts do not overlap; `src` is the
                // tensor's `bytes`, alive in `out` until the copy's event is waited for.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(base.add(part.offset), part.bytes);
                    result::memcpy_dtoh_async(dst, src, side.cu_stream()).w()?;
                }
            }
            let done = side
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .w()?;
            *slot(&mut self.parked, l)? = Some(parts);
            self.out.push_back((bundle, done));
            while self.out.len() > self.pending {
                self.release_oldest()?;
            }
            Ok(())
        }

        /// Frees the oldest bundle going out once its copy is done (its free is queued on the
        /// compute stream, so the compute waits for the copy first: a pool reuse must not race
        /// it).
        fn release_oldest(&mut self) -> Result<()> {
            if let Some((bundle, done)) = self.out.pop_front() {
                self.dev.cuda_stream().wait(&done).w()?;
                drop(bundle);
            }
            Ok(())
        }

        pub(crate) fn fetch(&mut self, l: usize) -> Result<()> {
            while !self.out.is_empty() {
                self.release_oldest()?;
            }
            let Some(parts) = slot(&mut self.parked, l)?.take() else {
                candle_core::bail!("offload: layer {l}'s activations were not parked");
            };
            let end = parts.last().map_or(0, |p| p.offset + p.bytes);
            let base = self.buffer(l, end)?;
            let compute = self.dev.cuda_stream();
            let side = self.host()?.side.clone();
            let mut bundle = Vec::with_capacity(parts.len());
            for part in &parts {
                // SAFETY: every element is written by the copy below before the compute, which
                // waits for it in `take`, reads any.
                let t = unsafe { uninit(&self.dev, part.dtype, part.shape.clone()) }?;
                match t {
                    Some(t) => bundle.push(t),
                    None => candle_core::bail!("offload: dtype {:?}", part.dtype),
                }
            }
            // every tensor's allocation (stream-ordered, on the compute stream) comes first
            side.join(&compute).w()?;
            for (t, part) in bundle.iter().zip(&parts) {
                let Some(dst) = addr(t)? else {
                    candle_core::bail!("offload: a fresh tensor without an address");
                };
                // SAFETY: the buffer holds the part's `bytes` at its offset, parked by `put`
                // (pinned, kept); `dst` is the fresh tensor's `bytes`, alive in `back` until
                // the compute waited for the copy.
                unsafe {
                    let src = std::slice::from_raw_parts(base.add(part.offset), part.bytes);
                    result::memcpy_htod_async(dst, src, side.cu_stream()).w()?;
                }
            }
            let done = side
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .w()?;
            *slot(&mut self.back, l)? = Some((bundle, done));
            Ok(())
        }

        pub(crate) fn take(&mut self, l: usize) -> Result<Vec<Tensor>> {
            if slot(&mut self.back, l)?.is_none() {
                self.fetch(l)?;
            }
            let Some((bundle, done)) = slot(&mut self.back, l)?.take() else {
                candle_core::bail!("offload: layer {l}'s activations did not come back");
            };
            self.dev.cuda_stream().wait(&done).w()?;
            Ok(bundle)
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
            self.out.clear();
            self.back.clear();
            hosts().insert(self.ordinal, host);
        }
    }
}
