//! Checkpoints written beside training. At a save the step's adapters and AdamW moments are
//! queued for copying into pinned host memory behind the step (run/host_stage.rs: the loop
//! does not wait for the copies); a writer thread then waits for them, serializes, writes,
//! fsyncs and renames them into place while the next steps run. One write is in flight at a
//! time: the next save, the run's end and a run that fails all wait for it, so a checkpoint is
//! never lost to a later error, and a failed write is reported (at the next wait) instead of
//! dropped.

use super::checkpoint::OPTIMIZER;
use super::host_stage::{HostTensors, Stage};
use crate::export::{self, CONFIG, WEIGHTS};
use crate::train::optim::AdamW;
use crate::util::fs::{sync_dir_files, write_dir};
use anyhow::{anyhow, Context, Result};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// One checkpoint's contents, in host memory (the tensors on their way there): what `write`
/// puts in a directory.
pub(crate) struct Snapshot {
    /// The adapter's PEFT tensors (f32).
    pub(crate) adapter: HostTensors,
    /// adapter_config.json.
    pub(crate) config: Vec<u8>,
    /// `<key>.exp_avg` / `<key>.exp_avg_sq` (f32).
    pub(crate) optimizer: HostTensors,
    /// Further files in write order (the last one marks the directory complete).
    pub(crate) files: Vec<(&'static str, Vec<u8>)>,
}

impl Snapshot {
    /// The model's adapters, staged to the host.
    pub(crate) fn adapter(model: &crate::model::Model, stage: &Stage) -> Result<HostTensors> {
        Ok(stage.copy(export::adapter_parts(model))?)
    }

    /// AdamW's m and v as a checkpoint keys them, staged to the host: `keys[i]` is the PEFT
    /// key of `opt.params[i]`.
    pub(crate) fn optimizer(opt: &AdamW, keys: &[String], stage: &Stage) -> Result<HostTensors> {
        let (m, v) = opt.state()?;
        let mut parts = Vec::with_capacity(2 * keys.len());
        for ((key, m), v) in keys.iter().zip(m).zip(v) {
            parts.push((format!("{key}.exp_avg"), m));
            parts.push((format!("{key}.exp_avg_sq"), v));
        }
        Ok(stage.copy(parts)?)
    }

    /// Writes the files into `dst` (replacing a directory there) through `tmp`: fsynced, then
    /// renamed, so `dst` is complete or absent. A failure removes `tmp`.
    pub(crate) fn write(&self, tmp: &Path, dst: &Path) -> Result<()> {
        write_dir(tmp, dst, |tmp| {
            self.adapter.write(&tmp.join(WEIGHTS))?;
            std::fs::write(tmp.join(CONFIG), &self.config)?;
            self.optimizer.write(&tmp.join(OPTIMIZER))?;
            for (name, bytes) in &self.files {
                std::fs::write(tmp.join(name), bytes)?;
            }
            sync_dir_files(tmp)
        })
        .with_context(|| format!("cannot save checkpoint {}", dst.display()))
    }
}

/// The checkpoint write in flight, if any: (its directory, the thread, which returns the
/// seconds the write took).
type Job = (PathBuf, JoinHandle<Result<f64>>);

/// Runs checkpoint writes on a thread of their own, one at a time, from host buffers of its
/// own (`stage`).
#[derive(Default)]
pub(crate) struct Writer {
    job: RefCell<Option<Job>>,
    stage: Stage,
    /// Seconds each finished write took on the writer thread, in order.
    took: RefCell<Vec<f64>>,
}

impl Writer {
    /// A writer for checkpoints of `model`, its host buffers pinned now (page-locking touches
    /// every page: before the loop, not in the middle of it).
    pub(crate) fn for_model(model: &crate::model::Model) -> Result<Writer> {
        let w = Writer::default();
        let n: usize = export::adapter_parts(model)
            .iter()
            .map(|(_, t)| t.elem_count())
            .sum();
        // The adapter, then AdamW's m and v of the same parameters.
        w.stage.reserve(&model.device, &[n, 2 * n])?;
        Ok(w)
    }

    /// Where a snapshot's tensors go on their way to the host, once the write in flight (which
    /// holds the buffers) is done.
    pub(crate) fn stage(&self) -> Result<&Stage> {
        self.wait()?;
        Ok(&self.stage)
    }

    /// Waits for the write in flight, then starts writing `snap` into `dst` through `tmp`;
    /// `then` runs on the writer thread once `dst` is in place (the pruning of old ones).
    pub(crate) fn start(
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
                let t0 = std::time::Instant::now();
                snap.write(&tmp, &dst)?;
                then()?;
                Ok(t0.elapsed().as_secs_f64())
            })
            .context("cannot start the checkpoint writer thread")?;
        *self.job.borrow_mut() = Some((at, h));
        Ok(())
    }

    /// Waits for the write in flight; its error, if it failed.
    pub(crate) fn wait(&self) -> Result<()> {
        let Some((dst, h)) = self.job.borrow_mut().take() else {
            return Ok(());
        };
        let took = h
            .join()
            .map_err(|_| anyhow!("the writer of checkpoint {} panicked", dst.display()))??;
        self.took.borrow_mut().push(took);
        Ok(())
    }

    /// Seconds each write waited for so far took on the writer thread (its copies' wait, the
    /// files, the fsyncs, the rename and the pruning after it).
    pub(crate) fn write_seconds(&self) -> Vec<f64> {
        self.took.borrow().clone()
    }
}

impl Drop for Writer {
    /// A run that ends by an error still finishes the checkpoint it reported as saved.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            crate::errln!("error: {e:#}");
        }
    }
}
