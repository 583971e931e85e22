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
//! ahead, keeps its all-reduces in line (on a second stream the compute stream would still
//! wait for each sum at once). Under the `reduce_ahead` experiment (`ops::kernels`) the
//! gradient sums go to the second stream too and the compute stream waits for them once, after
//! the backward (`reduced`); `gathered` then waits for the latest gather only (an event), not
//! for the sums queued beside it.
//!
//! FSDP's gathers of the frozen shards skip NCCL when the ranks are threads of one process
//! whose GPUs reach each other (NVLink or PCIe peer access): the shards stay where they are
//! (only their folded B columns are rewritten, once a step: train::flat), so after
//! `share_static` each rank copies its peers' shards straight out of their memory with
//! `cuMemcpyPeerAsync`, on the same side stream. Copy engines do that, not kernels: a
//! collective's kernels hold SMs that the layer's GEMMs, sized for the whole GPU, wait for.
//! The `peer_copy` experiment (`LORA_TRAIN_EXPERIMENTS=peer_copy`, `ops::kernels`): FSDP calls
//! `share_static` only under it, and it works only with CUDA_MODULE_LOADING=EAGER, which
//! `prepare_process` sets when the experiment is named at start. With the driver's default
//! lazy loading it can deadlock: one rank stuck in its first launch of a cuBLASLt kernel
//! (`cuKernelSetAttribute`, loading it under a driver lock), another stuck in
//! `cuMemcpyPeerAsync` out of the first one's GPU waiting for that lock, its own GPU busy with
//! a collective that the first rank had not issued yet. Eager loading (no kernel loads after
//! start) costs GPU memory (cuBLAS's kernels, outside the pool) and seconds at start, so NCCL
//! gathers by default.
//!
//! We hold the raw `ncclComm_t` (cudarc's `Comm` keeps it private) so that the failing rank's
//! thread can call ncclCommAbort on every rank's communicator: the ranks blocked in a
//! collective with a dead peer then get an error instead of waiting forever. Each call holds
//! the comm's `busy` lock while it enqueues; an abort takes that lock when it can (so it never
//! frees a comm under a starting call), and aborts anyway after a moment when the owner is
//! stuck inside NCCL, which is what ncclCommAbort is for. A comm is aborted once only.

use super::launch;
use super::posted::Posted;
use super::Group;
use crate::train::Comm;
use crate::train::EnvRank;
use anyhow::Context;
use candle_core::cuda_backend::cudarc::driver::{
    self as cu, CudaContext, CudaEvent, CudaStream, DevicePtr,
};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::CudaStorageSlice as S;
use candle_core::{Device, Result, Storage, Tensor};
use std::collections::HashMap;
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

/// The CUDA ordinals of a run's ranks: `devices`, or every GPU for "all" (an empty list); an
/// ordinal this machine lacks is an error saying which it has.
pub(crate) fn ordinals(devices: &[usize]) -> anyhow::Result<Vec<usize>> {
    let count = CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("cannot count CUDA devices: {e:?}"))? as usize;
    if devices.is_empty() {
        return Ok((0..count).collect());
    }
    if let Some(d) = devices.iter().find(|&&d| d >= count) {
        anyhow::bail!(
            "lists device {d}, but this machine has {count} CUDA device(s) (0..{}): list existing ordinals or use \"all\"",
            count.saturating_sub(1)
        );
    }
    Ok(devices.to_vec())
}

/// The ranks of one process, one thread per GPU.
pub struct NcclGroup {
    ordinals: Vec<usize>,
    id: sys::ncclUniqueId,
    comms: Mutex<Vec<Arc<Slot>>>,
    failure: Mutex<Option<(usize, String)>>,
    statics: Arc<Statics>,
}

/// The ranks' static tensors (`Comm::share_static`), by rank, when the ranks are threads of
/// one process. The tensors are kept here as well as by their rank, so that none is freed
/// while a peer may still copy from it; each rank lets go of its own entry on its own thread,
/// when its comm is dropped, after every rank's comm has waited for its copies
/// (`Posted::leave`).
type Statics = Posted<Shared>;

/// One rank's static tensors.
struct Shared {
    ctx: Arc<CudaContext>,
    /// The tensors, their addresses and bytes, in the order `share_static` got them.
    tensors: Vec<(Tensor, u64, usize)>,
    /// Its GPU and every peer's reach each other, and its memory pool is open to them.
    p2p: bool,
}

// SAFETY: ncclUniqueId is plain bytes.
unsafe impl Send for NcclGroup {}
// SAFETY: the ordinals and the unique id never change after `new`; the communicators,
// the failure and the statics are behind Mutexes (`Posted` locks its own).
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    /// The group of the GPUs `ordinals` (one rank each, rank i on `ordinals[i]`): one NCCL
    /// unique id for all of them; the communicators are made per rank from it.
    pub fn new(ordinals: Vec<usize>, _timeout: Duration) -> anyhow::Result<Arc<NcclGroup>> {
        let id = result::get_uniqueid().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?;
        Ok(Arc::new(NcclGroup {
            ordinals,
            id,
            comms: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            statics: Arc::default(),
        }))
    }
}

impl Group for NcclGroup {
    fn world(&self) -> usize {
        self.ordinals.len()
    }

    fn comm(self: Arc<Self>, rank: usize) -> anyhow::Result<Box<dyn Comm>> {
        let ordinal = self.ordinals[rank];
        let peers = Peers {
            statics: self.statics.clone(),
            ordinals: self.ordinals.clone(),
        };
        let comm = NcclComm::init(rank, self.ordinals.len(), ordinal, self.id, Some(peers))?;
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
pub(crate) fn from_env(e: &EnvRank, timeout: Duration) -> anyhow::Result<Box<dyn Comm>> {
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
    let comm = NcclComm::init(
        e.rank,
        e.world,
        e.local,
        sys::ncclUniqueId { internal },
        None,
    )
    .with_context(|| {
        format!(
            "rank {} of {}: cannot create its NCCL communicator",
            e.rank, e.world
        )
    })?;
    Ok(Box::new(comm))
}

/// One rank's NCCL communicator.
pub(crate) struct NcclComm {
    rank: usize,
    world: usize,
    raw: Arc<Slot>,
    device: Device,
    /// The rank's compute stream (candle's, on this thread).
    compute: Arc<CudaStream>,
    /// The second stream every collective runs on from the first gather issued ahead (None
    /// until then: `compute`).
    side: Mutex<Option<Arc<CudaStream>>>,
    /// Recorded on `side` after the latest gather issued ahead: what `gathered` waits for
    /// (not the sums queued behind it).
    gather_done: Mutex<Option<CudaEvent>>,
    /// The inputs of the sums issued ahead, kept alive until `reduced` (their frees would be
    /// queued on the compute stream, which does not wait for the side stream before that).
    pending: Mutex<Vec<Tensor>>,
    /// The other ranks of this process (None: a torchrun / Slurm rank).
    peers: Option<Peers>,
    /// After `share_static`, when every rank's GPU reaches every other's: the address of each
    /// of this rank's static tensors → what its gather copies, rank by rank: (context, address).
    sources: Mutex<HashMap<u64, Sources>>,
}

/// Where a static tensor's gather copies from, rank by rank: (context, address).
type Sources = Vec<(Arc<CudaContext>, u64)>;

/// What a rank of `NcclGroup` knows of the others.
struct Peers {
    statics: Arc<Statics>,
    ordinals: Vec<usize>,
}

impl NcclComm {
    fn init(
        rank: usize,
        world: usize,
        ordinal: usize,
        id: sys::ncclUniqueId,
        peers: Option<Peers>,
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
            gather_done: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
            peers,
            sources: Mutex::new(HashMap::new()),
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
        // Our copies out of the peers' shards end before any rank lets go of its own.
        if let Ok(Some(side)) = self.side_stream(false) {
            let _ = side.synchronize();
        }
        if let Some(p) = &self.peers {
            p.statics.leave(self.rank, self.world);
        }
        self.raw.abort();
    }
}

impl NcclComm {
    /// Queues `call(send, receive, type, comm, stream)`, one NCCL collective reading
    /// contiguous `x` and writing `out` (`queue`'s stream rules); returns `out`.
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
        let (src, ty) = address(x)?;
        let (dst, _) = address(&out)?;
        self.queue(op, ahead, |stream| {
            self.with(op, |c| {
                call(src as _, dst as _, ty, c, stream.cu_stream() as _)
                    .map_err(|e| nccl_err(op, e))
            })
            .map(|_| ())
        })?;
        Ok(out)
    }

    /// Queues `work(stream)` on the compute stream, or on the side stream after the work queued
    /// on the compute stream; unless `ahead`, the compute stream then waits for it. Tensors the
    /// work touches stay valid until it ran: their frees are queued on the compute stream,
    /// after it waited.
    fn queue(
        &self,
        op: &str,
        ahead: bool,
        work: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<()> {
        let cuda = |e| candle_core::Error::msg(format!("{op}: {e:?}"));
        let side = self.side_stream(ahead)?;
        let stream = match &side {
            Some(side) => {
                side.join(&self.compute).map_err(cuda)?;
                side.clone()
            }
            None => self.compute.clone(),
        };
        work(&stream)?;
        if side.is_some() && !ahead {
            self.compute.join(&stream).map_err(cuda)?;
        }
        Ok(())
    }
}

impl NcclComm {
    /// x summed over the ranks. `ahead`: on the second stream, under the compute stream's
    /// later work; x stays alive in `pending` until the compute stream waited for the sum
    /// (`reduced`).
    fn sum(&self, x: &Tensor, ahead: bool) -> Result<Tensor> {
        let x = x.contiguous()?;
        let n = x.elem_count();
        let out = self.enqueue(
            "all_reduce",
            &x,
            uninit(n, &x)?.reshape(x.shape())?,
            ahead,
            |src, dst, ty, c, st| {
                // SAFETY: src and dst hold n elements of `ty` on this rank's GPU; src stays
                // alive until the sum ran (its free is queued after the compute stream's wait).
                unsafe { result::all_reduce(src, dst, n, ty, sys::ncclRedOp_t::ncclSum, c, st) }
            },
        )?;
        if ahead {
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(x);
        }
        Ok(out)
    }

    /// The second stream when collectives run there: made at the first gather issued `ahead`,
    /// after which every collective uses it.
    fn side_stream(&self, ahead: bool) -> Result<Option<Arc<CudaStream>>> {
        let mut side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        if side.is_none() && ahead {
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
        let out = self.gather_queued(x, ahead)?;
        if let (true, Some(side)) = (ahead, self.side_stream(false)?) {
            let done = side
                .record_event(None)
                .map_err(|e| candle_core::Error::msg(format!("all_gather: {e:?}")))?;
            *self.gather_done.lock().unwrap_or_else(|p| p.into_inner()) = Some(done);
        }
        Ok(out)
    }

    fn gather_queued(&self, x: &Tensor, ahead: bool) -> Result<Tensor> {
        let x = x.flatten_all()?.contiguous()?;
        let n = x.elem_count();
        let out = uninit(n * self.world, &x)?; // every element is written below
        let (src, _) = address(&x)?;
        let copies = self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .cloned();
        if let Some(copies) = copies {
            // A static shard: each rank's is copied in from where it lies.
            let (dst, _) = address(&out)?;
            let bytes = n * x.dtype().size_in_bytes();
            let me = self.compute.context().cu_ctx();
            self.queue("all_gather (peer copies)", ahead, |stream| {
                for (r, (ctx, from)) in copies.iter().enumerate() {
                    // SAFETY: `from` is rank r's static shard of `bytes` (checked in
                    // `share_static`), kept alive by `Statics`; dst is out's slot r, in
                    // this rank's context; the copy is queued on this rank's stream.
                    unsafe {
                        cu::result::memcpy_peer_async(
                            me,
                            dst + (r * bytes) as u64,
                            ctx.cu_ctx(),
                            *from,
                            bytes,
                            stream.cu_stream(),
                        )
                    }
                    .map_err(|e| {
                        candle_core::Error::msg(format!("peer copy from rank {r}: {e:?}"))
                    })?;
                }
                Ok(())
            })?;
            return Ok(out);
        }
        self.enqueue("all_gather", &x, out, ahead, |src, dst, ty, c, st| {
            // SAFETY: src holds n elements, dst world·n, of `ty` on this rank's GPU.
            unsafe { result::all_gather(src, dst, n, ty, c, st) }
        })
    }

    /// `Comm::share_static` (FSDP calls it under the `peer_copy` experiment): publishes this
    /// rank's tensors, waits for every rank's, and when every GPU reaches every other, maps
    /// each tensor to the peers' copies of it (true).
    fn share(&self, xs: &[&Tensor]) -> Result<bool> {
        let Some(peers) = &self.peers else {
            return Ok(false);
        };
        if self.world < 2 {
            return Ok(false);
        }
        // Every rank reads the same process-wide mode, so all make the same choice.
        if !eager_loading() {
            if self.rank == 0 {
                crate::errln!(
                    "warning: LORA_TRAIN_EXPERIMENTS=peer_copy ignored, FSDP gathers with NCCL: \
                     peer copies need CUDA_MODULE_LOADING=EAGER (lazy kernel loading can \
                     deadlock them); lora-train sets it when the experiment is named at its start"
                );
            }
            return Ok(false);
        }
        let p2p = self.open_pool(&peers.ordinals)?;
        let mut tensors = Vec::with_capacity(xs.len());
        for x in xs {
            let x = x.flatten_all()?.contiguous()?;
            let (a, _) = address(&x)?;
            let bytes = x.elem_count() * x.dtype().size_in_bytes();
            tensors.push((x, a, bytes));
        }
        peers.statics.post(
            self.rank,
            Shared {
                ctx: self.compute.context().clone(),
                tensors,
                p2p,
            },
        );
        // Every rank has published, and written its shards (the barrier synchronises).
        self.barrier()?;
        let ranks = peers.statics.slots();
        let Some(me) = ranks.get(self.rank).and_then(Option::as_ref) else {
            return Ok(false);
        };
        if ranks.len() != self.world {
            return Ok(false); // (every rank posted before the barrier: not reached)
        }
        let mut sources = HashMap::with_capacity(me.tensors.len());
        for (i, (_, a, bytes)) in me.tensors.iter().enumerate() {
            let mut from = Vec::with_capacity(self.world);
            for r in ranks.iter() {
                // Every rank sees the same table, so all make the same choice.
                match r
                    .as_ref()
                    .filter(|r| r.p2p)
                    .and_then(|r| Some((r, r.tensors.get(i)?)))
                {
                    Some((r, (_, ra, rb))) if rb == bytes => from.push((r.ctx.clone(), *ra)),
                    _ => return Ok(false), // NCCL gathers them all
                }
            }
            sources.insert(*a, from);
        }
        *self.sources.lock().unwrap_or_else(|p| p.into_inner()) = sources;
        Ok(true)
    }

    /// Whether this GPU and every other rank's reach each other; if so, opens this device's
    /// memory pool (where candle allocates) to them, so that their copy engines read it.
    fn open_pool(&self, ordinals: &[usize]) -> Result<bool> {
        use cu::sys;
        let ctx = self.compute.context();
        let err = |what: &str, e| candle_core::Error::msg(format!("{what}: {e:?}"));
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        let me = ctx.cu_device();
        let mut access = Vec::new();
        for &o in ordinals.iter().filter(|&&o| o != ctx.ordinal()) {
            let mut peer: sys::CUdevice = 0;
            let (mut there, mut back) = (0, 0);
            // SAFETY: FFI with valid out-pointers; `o` is an ordinal of this machine.
            unsafe {
                sys::cuDeviceGet(&mut peer, o as i32)
                    .result()
                    .map_err(|e| err("cuDeviceGet", e))?;
                sys::cuDeviceCanAccessPeer(&mut there, me, peer)
                    .result()
                    .map_err(|e| err("cuDeviceCanAccessPeer", e))?;
                sys::cuDeviceCanAccessPeer(&mut back, peer, me)
                    .result()
                    .map_err(|e| err("cuDeviceCanAccessPeer", e))?;
            }
            if there == 0 || back == 0 {
                return Ok(false);
            }
            access.push(sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: o as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            });
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: FFI with a valid out-pointer; `access` holds `access.len()` descriptors.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, me)
                .result()
                .map_err(|e| err("cuDeviceGetDefaultMemPool", e))?;
            sys::cuMemPoolSetAccess(pool, access.as_ptr(), access.len())
                .result()
                .map_err(|e| err("cuMemPoolSetAccess", e))?;
        }
        Ok(true)
    }
}

/// Whether the driver loaded every kernel of a module with the module
/// (CUDA_MODULE_LOADING=EAGER, fixed when CUDA initialised); peer copies need it.
fn eager_loading() -> bool {
    use cu::sys::CUmoduleLoadingMode as M;
    let mut mode = M::CU_MODULE_LAZY_LOADING;
    // SAFETY: FFI with a valid out-pointer; CUDA is initialised (a context exists).
    let ok = unsafe { cu::sys::cuModuleGetLoadingMode(&mut mode) }
        .result()
        .is_ok();
    ok && mode == M::CU_MODULE_EAGER_LOADING
}

/// Call first thing in `main`, before any CUDA call: with the `peer_copy` experiment named in
/// LORA_TRAIN_EXPERIMENTS and no CUDA_MODULE_LOADING of the user's, sets
/// CUDA_MODULE_LOADING=EAGER, which peer copies need. (A list that does not parse is left for
/// `Kernels::resolve` to report.)
pub(crate) fn prepare_process() {
    let peer_copy = crate::ops::kernels::Experiments::from_env().is_ok_and(|e| e.peer_copy);
    if peer_copy && std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        // Before any thread exists (main's first call), so no other thread reads the
        // environment meanwhile.
        std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
    }
}

/// A [n] tensor like `x` (dtype, device) whose contents are not set: for a collective's output,
/// which it writes whole (zeros would be a pass over it on the compute stream).
fn uninit(n: usize, x: &Tensor) -> Result<Tensor> {
    let dev = x.device().as_cuda_device()?;
    // SAFETY: the caller's collective writes every element before any read.
    match unsafe { crate::ops::cuda::uninit(dev, x.dtype(), n)? } {
        Some(t) => Ok(t),
        None => Tensor::zeros(n, x.dtype(), x.device()),
    }
}

/// (device address of the first element, NCCL type).
fn address(t: &Tensor) -> Result<(u64, sys::ncclDataType_t)> {
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
    Ok((base + (o1 * size) as u64, ty))
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.sum(x, false)
    }

    fn all_reduce_sum_ahead(&self, x: &Tensor) -> Result<Tensor> {
        self.sum(x, true)
    }

    fn reduced(&self) -> Result<()> {
        if let Some(side) = self.side_stream(false)? {
            self.compute
                .join(&side)
                .map_err(|e| candle_core::Error::msg(format!("reduced: {e:?}")))?;
        }
        // Their frees are queued on the compute stream after the wait.
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(())
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.gather(x, false)
    }

    fn all_gather_ahead(&self, x: &Tensor) -> Result<Tensor> {
        self.gather(x, true)
    }

    fn gathered(&self) -> Result<()> {
        let done = self
            .gather_done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let e = |e| candle_core::Error::msg(format!("gathered: {e:?}"));
        match (done, self.side_stream(false)?) {
            (Some(done), _) => self.compute.wait(&done).map_err(e),
            (None, Some(side)) => self.compute.join(&side).map_err(e),
            (None, None) => Ok(()),
        }
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let x = x.contiguous()?;
        let n = x.elem_count();
        self.enqueue(
            "broadcast",
            &x,
            uninit(n, &x)?.reshape(x.shape())?,
            false,
            |src, dst, ty, c, st| {
                // SAFETY: src and dst hold n elements of `ty` on this rank's GPU.
                unsafe { result::broadcast(src, dst, n, ty, root as i32, c, st) }
            },
        )
    }

    fn share_static(&self, xs: &[&Tensor]) -> Result<bool> {
        self.share(xs)
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::ones(1, candle_core::DType::F32, &self.device)?;
        self.all_reduce_sum(&one)?;
        self.device.synchronize()
    }
}
