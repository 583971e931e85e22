//! The communicators of a run's ranks by backend: threads of this process (CPU, or one GPU
//! each through NCCL), or this process as one rank of a launcher's job (a GPU through NCCL,
//! or the CPU through TCP). Every `nccl` feature switch of the crate lives in parallel/; these
//! are the ones the launcher calls.

use super::Group;
use crate::train::{Comm, EnvRank};
use anyhow::Result;
use std::sync::Arc;
use std::time::Duration;

/// The CUDA ordinals of a run's ranks: `devices`, or every GPU for "all" (an empty list). An
/// ordinal this machine lacks is an error naming the ones it has. Without NCCL the list as it
/// is (one GPU: opening it reports a missing one).
#[cfg(feature = "nccl")]
pub(crate) fn cuda_ordinals(devices: &[usize]) -> Result<Vec<usize>> {
    super::nccl::ordinals(devices)
}

/// The CUDA ordinals of a run's ranks (see the `nccl` build).
#[cfg(not(feature = "nccl"))]
pub(crate) fn cuda_ordinals(devices: &[usize]) -> Result<Vec<usize>> {
    Ok(devices.to_vec())
}

/// One NCCL communicator per GPU of `devices`, a thread each.
#[cfg(feature = "nccl")]
pub(crate) fn nccl_group(devices: Vec<usize>, timeout: Duration) -> Result<Arc<dyn Group>> {
    Ok(super::nccl::NcclGroup::new(devices, timeout)?)
}

/// Several GPUs need NCCL: this build has none.
#[cfg(not(feature = "nccl"))]
pub(crate) fn nccl_group(_: Vec<usize>, _: Duration) -> Result<Arc<dyn Group>> {
    anyhow::bail!("several GPUs need NCCL: {}", crate::util::NCCL_BUILD)
}

/// This process as rank `e.rank` of a launcher's job of CPU ranks (RANK, WORLD_SIZE, ...):
/// TCP through rank 0, once every rank has connected (within `timeout`).
pub(crate) fn tcp_group(e: &EnvRank, timeout: Duration) -> Result<Arc<dyn Group>> {
    Ok(super::tcp::TcpGroup::connect(e, timeout)?)
}

/// This process's NCCL communicator as rank `e.rank` of a launcher's job of GPU ranks.
#[cfg(feature = "nccl")]
pub(crate) fn env_comm(e: &EnvRank, timeout: Duration) -> Result<Box<dyn Comm>> {
    super::nccl::from_env(e, timeout)
}

/// A launcher's job of GPU ranks needs NCCL: this build has none.
#[cfg(not(feature = "nccl"))]
pub(crate) fn env_comm(e: &EnvRank, _: Duration) -> Result<Box<dyn Comm>> {
    anyhow::bail!(
        "RANK / WORLD_SIZE are set (world {}) with model.device = \"cuda\", but this binary was \
         built without NCCL: {}, or train on the CPU ranks (model.device = \"cpu\")",
        e.world,
        crate::util::NCCL_BUILD
    )
}
