//! Checkpoints written beside training. At a save the step's adapters and AdamW moments are
//! copied to host memory (the only part the loop waits for: a few device-to-host copies);
//! a writer thread then serializes, writes, fsyncs and renames them into place while the
//! next steps run. One write is in flight at a time: the next save, the run's end and a run
//! that fails all wait for it, so a checkpoint is never lost to a later error, and a failed
//! write is reported (at the next wait) instead of dropped.

use super::checkpoint::OPTIMIZER;
use super::optim::AdamW;
use crate::export::merge::{replace_dir, sync_dir_files};
use crate::export::{self, CONFIG, WEIGHTS};
use anyhow::{anyhow, Context, Result};
use candle_core::Tensor;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// One checkpoint's contents, in host memory: what `write` puts in a directory.
pub struct Snapshot {
    /// The adapter's PEFT tensors (f32).
    pub adapter: Vec<(String, Tensor)>,
    /// adapter_config.json.
    pub config: Vec<u8>,
    /// `<key>.exp_avg` / `<key>.exp_avg_sq` (f32).
    pub optimizer: Vec<(String, Tensor)>,
    /// Further files in write order (the last one marks the directory complete).
    pub files: Vec<(&'static str, Vec<u8>)>,
}

impl Snapshot {
    /// AdamW's m and v as a checkpoint keys them: `keys[i]` is the PEFT key of `opt.params[i]`.
    pub fn optimizer(opt: &AdamW, keys: &[String]) -> Result<Vec<(String, Tensor)>> {
        let (m, v) = opt.state_on_host()?;
        let mut out = Vec::with_capacity(2 * keys.len());
        for ((key, m), v) in keys.iter().zip(m).zip(v) {
            out.push((format!("{key}.exp_avg"), m));
            out.push((format!("{key}.exp_avg_sq"), v));
        }
        Ok(out)
    }

    /// Writes the files into `dst` (replacing a directory there) through `tmp`: fsynced, then
    /// renamed, so `dst` is complete or absent. A failure removes `tmp`.
    pub fn write(&self, tmp: &Path, dst: &Path) -> Result<()> {
        let _ = std::fs::remove_dir_all(tmp);
        std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let res = (|| -> Result<()> {
            export::write_tensors(&tmp.join(WEIGHTS), &self.adapter)?;
            std::fs::write(tmp.join(CONFIG), &self.config)?;
            export::write_tensors(&tmp.join(OPTIMIZER), &self.optimizer)?;
            for (name, bytes) in &self.files {
                std::fs::write(tmp.join(name), bytes)?;
            }
            sync_dir_files(tmp)?;
            replace_dir(tmp, dst)
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_dir_all(tmp);
            return Err(e.context(format!("cannot save checkpoint {}", dst.display())));
        }
        Ok(())
    }
}

/// The checkpoint write in flight, if any: (its directory, the thread).
type Job = (PathBuf, JoinHandle<Result<()>>);

/// Runs checkpoint writes on a thread of their own, one at a time.
#[derive(Default)]
pub struct Writer {
    job: RefCell<Option<Job>>,
}

impl Writer {
    /// Waits for the write in flight, then starts writing `snap` into `dst` through `tmp`;
    /// `then` runs on the writer thread once `dst` is in place (the pruning of old ones).
    pub fn start(
        &self,
        snap: Snapshot,
        tmp: PathBuf,
        dst: PathBuf,
        then: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<()> {
        self.wait()?;
        let at = dst.clone();
        let h = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                snap.write(&tmp, &dst)?;
                then()
            })
            .context("cannot start the checkpoint writer thread")?;
        *self.job.borrow_mut() = Some((at, h));
        Ok(())
    }

    /// Waits for the write in flight; its error, if it failed.
    pub fn wait(&self) -> Result<()> {
        let Some((dst, h)) = self.job.borrow_mut().take() else {
            return Ok(());
        };
        h.join()
            .map_err(|_| anyhow!("the writer of checkpoint {} panicked", dst.display()))?
    }
}

impl Drop for Writer {
    /// A run that ends by an error still finishes the checkpoint it reported as saved.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            eprintln!("error: {e:#}");
        }
    }
}
