//! One run owns its output directory: `output.dir`'s lock (`util::lock`), taken before the run
//! reads or cleans anything there and held for the run's life. A second `train`, or a resume,
//! on a directory a live run holds refuses and names that run's pid; the lock of a run that
//! died is taken over. Of a launcher's processes (torchrun, mpirun: RANK / WORLD_SIZE) only
//! rank 0 writes there, and only it takes the lock.

use crate::recipe::Recipe;
use crate::train::EnvRank;
use crate::util::lock::DirLock;
use anyhow::{Context, Result};

/// The lock of `r`'s output directory for this run (None on a launcher's rank other than 0).
pub(crate) fn own_output_dir(r: &Recipe) -> Result<Option<DirLock>> {
    let lead = EnvRank::from_env(&|k| std::env::var(k).ok())?.is_none_or(|e| e.rank == 0);
    if !lead {
        return Ok(None);
    }
    let lock = DirLock::try_dir(&r.output_dir(), "lora-train train").context("output.dir")?;
    Ok(Some(lock))
}
