//! What the step asks of its ranks: one `Comm` per rank, the same calls whatever the backend
//! (parallel/ implements it for CPU threads, TCP processes and NCCL); `Solo`, world 1.

use candle_core::{Result, Tensor};

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
