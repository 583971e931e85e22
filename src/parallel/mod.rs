//! Communication between ranks: one `Comm` per rank, the same calls whatever the backend.
//!
//! defines: Comm (rank, world, all_reduce_sum, all_gather, broadcast, barrier), Solo (world 1),
//! Group (makes each rank's Comm, brings every rank down when one fails), CommError.
//! Backends: cpu (threads of one process), tcp (processes, CPU ranks of a launcher's job; its
//! frames: wire), nccl (CUDA, `nccl` feature; its peer copies' table: posted). FSDP sharding:
//! fsdp;
//! starting the ranks (threads, or torchrun / Slurm processes): launch.
//!
//! The model knows no communication: train::driver gathers, reduces and recomputes.

pub(crate) mod backend;
pub mod cpu;
pub mod fsdp;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod posted;
pub mod tcp;
pub(crate) mod wire;

use candle_core::{Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a rank still waits in a collective once a stop signal has come: the others
/// finish their step within it, unless they are stuck.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(10);

static INTERRUPTED: OnceLock<Instant> = OnceLock::new();

/// A stop signal came (train::stop): a collective that has waited `STOP_GRACE` since the
/// signal (or since it began, when it began later) fails.
pub(crate) fn interrupt() {
    let _ = INTERRUPTED.set(Instant::now());
}

/// When a stop signal came, if one did.
pub(crate) fn interrupted_at() -> Option<Instant> {
    INTERRUPTED.get().copied()
}

static GAVE_UP: AtomicBool = AtomicBool::new(false);

/// Whether a collective gave up waiting after a stop signal (`CommError::Interrupted`): the
/// run's failure is then the signal's stop.
pub(crate) fn gave_up_after_signal() -> bool {
    GAVE_UP.load(Ordering::SeqCst)
}

fn note_gave_up() {
    GAVE_UP.store(true, Ordering::SeqCst);
}

/// One rank's end of a communicator. Every rank calls the same collectives in the same order.
/// The calls block (CPU) or are queued on the device stream (NCCL) until every rank joined.
pub trait Comm {
    /// This rank, 0-based.
    fn rank(&self) -> usize;
    /// Ranks in the communicator.
    fn world(&self) -> usize;
    /// Σ over ranks, elementwise; same shape and dtype as `x`.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's `x` flattened, rank order: [n] → [world · n]. Every rank passes the same n.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;
    /// Rank `root`'s `x` on every rank (same shape everywhere).
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// `all_gather` issued ahead of its use: it may overlap the work queued after it, so its
    /// result may be read only after `gathered`. Default: `all_gather`.
    fn all_gather_ahead(&self, x: &Tensor) -> Result<Tensor> {
        self.all_gather(x)
    }
    /// Work queued from now on waits for every `all_gather_ahead` issued so far (not for the
    /// sums issued ahead).
    fn gathered(&self) -> Result<()> {
        Ok(())
    }
    /// `all_reduce_sum` issued ahead of its use (DDP's gradient sums, under the backward of
    /// the layers below): its result may be read only after `reduced`. Default: in line.
    fn all_reduce_sum_ahead(&self, x: &Tensor) -> Result<Tensor> {
        self.all_reduce_sum(x)
    }
    /// Work queued from now on waits for every `all_reduce_sum_ahead` issued so far.
    fn reduced(&self) -> Result<()> {
        Ok(())
    }
    /// `xs` stay where they are from now on (FSDP's frozen shards; their folded B columns are
    /// rewritten between steps, `train::shards::Shards::write_pads`). A backend may let the other ranks
    /// read them where they lie: `all_gather` of one of them then copies the peers' shards in
    /// with copy engines instead of a collective's kernels (NCCL, ranks that are threads of
    /// one process). Every rank calls it once, in step, with its tensors in the same order
    /// (FSDP does, under the `peer_copy` experiment: `ops::kernels`).
    /// True when the peers will copy them so; false: gathers stay collectives.
    fn share_static(&self, _xs: &[&Tensor]) -> Result<bool> {
        Ok(false)
    }
}

/// First thing in `main`, before CUDA starts: the process environment a backend needs
/// (NCCL's peer copies: CUDA_MODULE_LOADING=EAGER, see parallel::nccl).
pub fn prepare_process() {
    #[cfg(feature = "nccl")]
    nccl::prepare_process();
}

/// World 1: every collective is the identity (no copy, no lock).
pub struct Solo;

impl Comm for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten_all()
    }
    fn broadcast(&self, x: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// The ranks of one run, as the launcher sees them: it makes each rank's `Comm` (on the
/// rank's own thread: NCCL communicators must be created where they are used), and when a
/// rank fails it calls `abort` so that every other rank's pending and future collectives
/// fail at once instead of waiting for the dead rank.
pub trait Group: Send + Sync {
    /// Ranks in the run.
    fn world(&self) -> usize;
    /// Rank `rank`'s communicator, made on the calling thread (the rank's own).
    fn comm(self: std::sync::Arc<Self>, rank: usize) -> anyhow::Result<Box<dyn Comm>>;
    /// Rank `rank` failed with `why`; the first call wins and is what the others report.
    fn abort(&self, rank: usize, why: &str);
    /// The first failure: (rank, its error chain).
    fn failure(&self) -> Option<(usize, String)>;
    /// Rank `rank` finished its run: a collective still waiting for it fails at once.
    fn ended(&self, _rank: usize) {}
}

/// Errors of the collectives themselves, matched by the launcher and tests.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CommError {
    #[error("rank {rank} failed, so rank {me} stopped: {why}")]
    Aborted { me: usize, rank: usize, why: String },
    #[error("rank {me} waited {secs} s in {op} for rank(s) {missing:?}, which never joined (parallel.timeout_s = {secs}: raise it if a step legitimately takes longer)")]
    Timeout {
        me: usize,
        op: &'static str,
        missing: Vec<usize>,
        secs: u64,
    },
    #[error("rank {me} was still waiting in {op} for rank(s) {missing:?} {secs} s after the stop signal: they are stuck")]
    Interrupted {
        me: usize,
        op: &'static str,
        missing: Vec<usize>,
        secs: u64,
    },
    #[error("rank {me} waits in {op} for rank(s) {ended:?}, which ended their run: the ranks disagree on the steps of the run")]
    Ended {
        me: usize,
        op: &'static str,
        ended: Vec<usize>,
    },
    #[error("rank {me} waited {secs} s in {op} for rank 0's answer, which never came: rank 0 is stuck (it waits parallel.timeout_s = {timeout} s for the other ranks and names any that is missing)")]
    NoAnswer {
        me: usize,
        op: &'static str,
        secs: u64,
        timeout: u64,
    },
    /// The run's failure as a rank other than the failing one reports it.
    #[error("rank {rank} of {world} failed: {why}")]
    Failed {
        rank: usize,
        world: usize,
        why: String,
    },
}

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        candle_core::Error::wrap(e)
    }
}
