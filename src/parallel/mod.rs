//! Communication between ranks: one `train::Comm` per rank, the same calls whatever the backend.
//!
//! defines: Group (makes each rank's Comm, brings every rank down when one fails), CommError;
//! the backends that implement the step's `train::Comm` (rank, world, all_reduce_sum,
//! all_gather, broadcast, barrier): cpu (threads of one process), tcp (processes, CPU ranks of
//! a launcher's job; its frames: wire), nccl (CUDA, `nccl` feature; its peer copies' table:
//! posted); starting the ranks (threads, or torchrun / Slurm processes): launch.
//!
//! The model knows no communication: train::driver gathers, reduces and recomputes; FSDP's
//! shards are the trainer's (train::flat); this moves bytes only.

pub(crate) mod backend;
pub mod cpu;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod posted;
pub mod tcp;
pub(crate) mod wire;

use crate::train::comm::Comm;

/// First thing in `main`, before CUDA starts: the process environment a backend needs
/// (NCCL's peer copies: CUDA_MODULE_LOADING=EAGER, see parallel::nccl).
pub fn prepare_process() {
    #[cfg(feature = "nccl")]
    nccl::prepare_process();
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
