//! NCCL communicators (`nccl` feature): one per rank, built from one unique id.
//!
//! Ranks are threads of this process (one per GPU, the id passed in memory) or processes
//! started by torchrun / Slurm (rank 0 hands the id to the others over TCP: launch::share).
//! Collectives are queued on the rank's compute stream (candle's), in line with the compute
//! around them; the host does not wait for them. From the first gather issued one layer ahead
//! (`all_gather_ahead`: FSDP's), every collective of the comm runs on a second stream instead,
//! ordered after the compute queued before it (stream joins). The compute stream waits for a
//! collective at once, except for those gathers, which it waits for only when the layer is
//! used (`gathered`), so they overlap the layer in between. One communicator, one stream at a
//! time: the ranks' collectives still run in one order everywhere. DDP, which gathers nothing
//! ahead, keeps its all-reduces in line (a second stream measured 1% slower for it: nothing of
//! its could overlap, the joins cost). LORA_TRAIN_GATHER_STREAM=0 keeps FSDP in line too.
//!
//! We hold the raw `ncclComm_t` (cudarc's `Comm` keeps it private) so that the failing rank's
//! thread can call ncclCommAbort on every rank's communicator: the ranks blocked in a
//! collective with a dead peer then get an error instead of waiting forever. Each call holds
//! the comm's `busy` lock while it enqueues; an abort takes that lock when it can (so it never
//! frees a comm under a starting call), and aborts anyway after a moment when the owner is
//! stuck inside NCCL, which is what ncclCommAbort is for. A comm is aborted once only.

use super::launch::{self, EnvRank};
use super::{Comm, Group};
use crate::recipe::{Recipe, RecipeError};
use anyhow::Context;
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::CudaStorageSlice as S;
use candle_core::{Device, Result, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// One rank's communicator, shared with the group so that another thread can abort it.
struct Slot {
    raw: sys::ncclComm_t,
    /// Set once the comm is aborted (by a failure or the owner's drop): never used again.
    dead: AtomicBool,
    /// Held while a call enqueues work on `raw`.
    busy: Mutex<()>,
}

// SAFETY: an ncclComm_t may be used from any thread; uses are serialised by `busy`, and the
// single abort is guarded by `dead`.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

impl Slot {
    fn abort(&self) {
        if self.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wait briefly for a call that is enqueueing to return; a call stuck inside NCCL on a
        // dead peer is what the abort releases.
        let until = Instant::now() + Duration::from_millis(200);
        let _guard = loop {
            match self.busy.try_lock() {
                Ok(g) => break Some(g),
                Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(TryLockError::WouldBlock) => break None,
            }
        };
        // SAFETY: `raw` came from ncclCommInitRank and `dead` makes this its only abort.
        let _ = unsafe { result::comm_abort(self.raw) };
    }
}

fn nccl_err(what: &str, e: result::NcclError) -> candle_core::Error {
    candle_core::Error::msg(format!("NCCL {what}: {e:?}"))
}

/// The CUDA ordinals of a recipe's ranks: `parallel.devices`, or every GPU for "all" (an
/// empty list); a missing ordinal is a recipe error.
pub fn ordinals(recipe: &Recipe) -> anyhow::Result<Vec<usize>> {
    let count = CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("cannot count CUDA devices: {e:?}"))? as usize;
    let p = &recipe.parallel;
    if p.devices.is_empty() {
        return Ok((0..count).collect());
    }
    if let Some(d) = p.devices.iter().find(|&&d| d >= count) {
        return Err(RecipeError::Invalid {
            path: recipe.source.clone(),
            key: "parallel.devices".into(),
            msg: format!("lists device {d}, but this machine has {count} CUDA device(s) (0..{}): list existing ordinals or use \"all\"", count.saturating_sub(1)),
        }
        .into());
    }
    Ok(p.devices.clone())
}

/// The ranks of one process, one thread per GPU.
pub struct NcclGroup {
    ordinals: Vec<usize>,
    id: sys::ncclUniqueId,
    comms: Mutex<Vec<Arc<Slot>>>,
    failure: Mutex<Option<(usize, String)>>,
}

// SAFETY: ncclUniqueId is plain bytes.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    pub fn new(ordinals: Vec<usize>, _timeout: Duration) -> anyhow::Result<Arc<NcclGroup>> {
        let id = result::get_uniqueid().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?;
        Ok(Arc::new(NcclGroup {
            ordinals,
            id,
            comms: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
        }))
    }
}

impl Group for NcclGroup {
    fn world(&self) -> usize {
        self.ordinals.len()
    }

    fn comm(self: Arc<Self>, rank: usize) -> anyhow::Result<Box<dyn Comm>> {
        let ordinal = self.ordinals[rank];
        let comm = NcclComm::init(rank, self.ordinals.len(), ordinal, self.id)?;
        self.comms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(comm.raw.clone());
        if self.failure().is_some() {
            comm.raw.abort();
        }
        Ok(Box::new(comm))
    }

    fn abort(&self, rank: usize, why: &str) {
        {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some((rank, why.to_string()));
            }
        }
        // The watchdog's job: free every rank blocked on a dead peer.
        for s in self.comms.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            s.abort();
        }
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// This process's rank of a torchrun / Slurm job: rank 0 makes the id and serves it.
pub fn from_env(e: &EnvRank, timeout: Duration) -> anyhow::Result<Box<dyn Comm>> {
    let id = match e.rank {
        0 => Some(result::get_uniqueid().map_err(|x| anyhow::anyhow!("ncclGetUniqueId: {x:?}"))?),
        _ => None,
    };
    let bytes: Option<Vec<u8>> = id.map(|id| id.internal.iter().map(|&c| c as u8).collect());
    let got = launch::share(e.rank, e.world, &e.addr, e.port, bytes.as_deref(), timeout)?;
    if got.len() != 128 {
        anyhow::bail!(
            "rank {}: got a {}-byte NCCL id, want 128",
            e.rank,
            got.len()
        );
    }
    let mut internal = [0 as std::ffi::c_char; 128];
    for (d, s) in internal.iter_mut().zip(&got) {
        *d = *s as std::ffi::c_char;
    }
    let comm = NcclComm::init(e.rank, e.world, e.local, sys::ncclUniqueId { internal })
        .with_context(|| {
            format!(
                "rank {} of {}: cannot create its NCCL communicator",
                e.rank, e.world
            )
        })?;
    Ok(Box::new(comm))
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    rank: usize,
    world: usize,
    raw: Arc<Slot>,
    device: Device,
    /// The rank's compute stream (candle's, on this thread).
    compute: Arc<CudaStream>,
    /// The second stream every collective runs on from the first gather issued ahead (None
    /// until then: `compute`).
    side: Mutex<Option<Arc<CudaStream>>>,
    /// LORA_TRAIN_GATHER_STREAM=0: never make `side`.
    in_line: bool,
}

impl NcclComm {
    fn init(
        rank: usize,
        world: usize,
        ordinal: usize,
        id: sys::ncclUniqueId,
    ) -> anyhow::Result<NcclComm> {
        let device = Device::new_cuda(ordinal)?;
        let stream = device.as_cuda_device()?.cuda_stream();
        // NCCL needs the device's context current on this thread.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let mut c = std::mem::MaybeUninit::uninit();
        // SAFETY: ncclCommInitRank writes the communicator on success.
        let c = unsafe {
            result::comm_init_rank(c.as_mut_ptr(), world as i32, id, rank as i32).map_err(|e| {
                anyhow::anyhow!("ncclCommInitRank (rank {rank} of {world}, GPU {ordinal}): {e:?}")
            })?;
            c.assume_init()
        };
        let in_line = std::env::var("LORA_TRAIN_GATHER_STREAM").is_ok_and(|v| v == "0");
        Ok(NcclComm {
            rank,
            world,
            raw: Arc::new(Slot {
                raw: c,
                dead: AtomicBool::new(false),
                busy: Mutex::new(()),
            }),
            device,
            compute: stream,
            side: Mutex::new(None),
            in_line,
        })
    }

    /// Runs `f(comm)` with the communicator, or fails if it was aborted.
    fn with<R>(&self, op: &str, f: impl FnOnce(sys::ncclComm_t) -> Result<R>) -> Result<R> {
        let _busy = self.raw.busy.lock().unwrap_or_else(|p| p.into_inner());
        if self.raw.dead.load(Ordering::SeqCst) {
            return Err(candle_core::Error::msg(format!(
                "rank {}: {op} on an aborted NCCL communicator (another rank failed)",
                self.rank
            )));
        }
        f(self.raw.raw)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.raw.abort();
    }
}

impl NcclComm {
    /// Queues `call(send, receive, type, comm, stream)`, one NCCL collective reading
    /// contiguous `x` and writing `out`, on `x`'s stream (or the side stream, after the work
    /// queued on `x`'s; unless `ahead`, `x`'s stream then waits for it); returns `out`. Both
    /// stay valid until the op ran: their frees are queued on `x`'s stream after it waited.
    fn enqueue<F>(&self, op: &str, x: &Tensor, out: Tensor, ahead: bool, call: F) -> Result<Tensor>
    where
        F: FnOnce(
            *const std::ffi::c_void,
            *mut std::ffi::c_void,
            sys::ncclDataType_t,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    {
        let (src, ty, compute) = address(x)?;
        let (dst, _, _) = address(&out)?;
        let cuda = |e| candle_core::Error::msg(format!("{op}: {e:?}"));
        let side = self.side_stream(ahead)?;
        let stream = match &side {
            Some(side) => {
                side.join(&compute).map_err(cuda)?;
                side.clone()
            }
            None => compute.clone(),
        };
        self.with(op, |c| {
            call(src as _, dst as _, ty, c, stream.cu_stream() as _).map_err(|e| nccl_err(op, e))
        })?;
        if side.is_some() && !ahead {
            compute.join(&stream).map_err(cuda)?;
        }
        Ok(out)
    }
}

impl NcclComm {
    /// The second stream when collectives run there: made at the first gather issued `ahead`
    /// (unless in line), after which every collective uses it.
    fn side_stream(&self, ahead: bool) -> Result<Option<Arc<CudaStream>>> {
        let mut side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        if side.is_none() && ahead && !self.in_line {
            let s = self.compute.context().new_stream().map_err(|e| {
                candle_core::Error::msg(format!(
                    "rank {}: cannot create a stream: {e:?}",
                    self.rank
                ))
            })?;
            *side = Some(s);
        }
        Ok(side.clone())
    }

    fn gather(&self, x: &Tensor, ahead: bool) -> Result<Tensor> {
        let x = x.flatten_all()?.contiguous()?;
        let n = x.elem_count();
        let out = Tensor::zeros(n * self.world, x.dtype(), x.device())?;
        self.enqueue("all_gather", &x, out, ahead, |src, dst, ty, c, st| {
            // SAFETY: src holds n elements, dst world·n, of `ty` on this rank's GPU.
            unsafe { result::all_gather(src, dst, n, ty, c, st) }
        })
    }
}

/// (device address of the first element, NCCL type, the stream that owns the memory).
fn address(t: &Tensor) -> Result<(u64, sys::ncclDataType_t, Arc<CudaStream>)> {
    use sys::ncclDataType_t as D;
    let (st, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        candle_core::bail!("NCCL: a tensor on {:?}, not CUDA", t.device().location());
    };
    let Some((o1, _)) = layout.contiguous_offsets() else {
        candle_core::bail!("NCCL: a non-contiguous tensor");
    };
    let stream = cs.device.cuda_stream();
    let (base, ty, size) = match &cs.slice {
        S::F32(s) => (s.device_ptr(&stream).0, D::ncclFloat32, 4),
        S::F64(s) => (s.device_ptr(&stream).0, D::ncclFloat64, 8),
        S::BF16(s) => (s.device_ptr(&stream).0, D::ncclBfloat16, 2),
        S::F16(s) => (s.device_ptr(&stream).0, D::ncclFloat16, 2),
        S::U32(s) => (s.device_ptr(&stream).0, D::ncclUint32, 4),
        S::U8(s) => (s.device_ptr(&stream).0, D::ncclUint8, 1),
        _ => candle_core::bail!("NCCL: dtype {:?} not supported", t.dtype()),
    };
    Ok((base + (o1 * size) as u64, ty, stream))
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let n = x.elem_count();
        self.enqueue(
            "all_reduce",
            &x,
            x.zeros_like()?,
            false,
            |src, dst, ty, c, st| {
                // SAFETY: src and dst hold n elements of `ty` on this rank's GPU.
                unsafe { result::all_reduce(src, dst, n, ty, sys::ncclRedOp_t::ncclSum, c, st) }
            },
        )
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.gather(x, false)
    }

    fn all_gather_ahead(&self, x: &Tensor) -> Result<Tensor> {
        self.gather(x, true)
    }

    fn gathered(&self) -> Result<()> {
        match self.side_stream(false)? {
            Some(side) => self
                .compute
                .join(&side)
                .map_err(|e| candle_core::Error::msg(format!("gathered: {e:?}"))),
            None => Ok(()),
        }
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let x = x.contiguous()?;
        let n = x.elem_count();
        self.enqueue(
            "broadcast",
            &x,
            x.zeros_like()?,
            false,
            |src, dst, ty, c, st| {
                // SAFETY: src and dst hold n elements of `ty` on this rank's GPU.
                unsafe { result::broadcast(src, dst, n, ty, root as i32, c, st) }
            },
        )
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::ones(1, candle_core::DType::F32, &self.device)?;
        self.all_reduce_sum(&one)?;
        self.device.synchronize()
    }
}
