//! `train.precompute_ref` (TRL's `precompute_ref_log_probs`): the reference's per-sequence
//! log-probabilities of every micro-batch the run's steps take, computed in one pass before
//! the first step (or read from the output directory: `pref_store`), and laid into each
//! batch's layout (`PrefLayout::reference`) as `Steps` makes it, so the objective runs no
//! reference forward during the steps.
//!
//! The values are computed over the very micro-batches the steps take (each rank over its own
//! rows, by the sampler's order) by the reference's own forward (`pref_ref::seq_logps`), so a
//! run with them is bit-identical to one without. An epoch's micro-batches hold other rows
//! than the last's (shuffled, and KTO's mismatched pairs are drawn within a micro-batch), so
//! the pass covers each epoch the run's steps reach: one pass over the data for a run of one
//! epoch or less. The table is every rank's, (epoch, step in epoch, rank, micro-batch) → a
//! slice: a DPO micro-batch of p pairs 2p values (chosen, rejected, in layout order), a KTO
//! one of e examples e completions then its e mismatched pairs. The pass starts from step 0
//! whatever the resume point, so the file is always whole.

use super::pref_ref::seq_logps;
use super::pref_store;
use super::session::Session;
use super::train_data::TrainData;
use crate::data::Batch;
use crate::util::bar::Shown;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// A micro-batch's place in the run: (epoch, step in epoch, rank, micro-batch of the step).
type Slot = (usize, usize, usize, usize);

/// The run's stored reference log-probabilities and where each micro-batch's lie.
#[derive(Debug, Default)]
pub struct RefStore {
    at: HashMap<Slot, (usize, usize)>,
    values: Vec<f32>,
    kto: bool,
}

/// Rank `mine`'s micro-batches of the run's `total` steps, in order, with their rows; and every
/// rank's micro-batches' places in the flat table.
type Plan = (Vec<(Slot, Vec<Vec<usize>>)>, HashMap<Slot, (usize, usize)>);

fn plan(d: &TrainData, total: usize, mine: usize) -> Result<Plan> {
    let (mut list, mut at, mut off) = (Vec::new(), HashMap::new(), 0);
    for rank in 0..d.world {
        let (mut g, mut epoch) = (0, 0);
        while g < total {
            let steps = d.epoch_plan_of(epoch, rank)?;
            if steps.is_empty() {
                break;
            }
            for (i, step) in steps.into_iter().enumerate().take(total - g) {
                for (k, m) in step.into_iter().enumerate() {
                    let n = 2 * m.iter().map(Vec::len).sum::<usize>();
                    at.insert((epoch, i, rank, k), (off, n));
                    if rank == mine {
                        list.push(((epoch, i, rank, k), m));
                    }
                    off += n;
                }
                g += 1;
            }
            epoch += 1;
        }
    }
    Ok((list, at))
}

impl RefStore {
    /// The stored values of `out_dir` when they are this run's, else computed in one pass
    /// (each rank its own micro-batches, then shared) and written there by rank 0; every rank
    /// ends with the whole table.
    pub fn load_or_compute(s: &Session, d: &TrainData, out_dir: &Path) -> Result<RefStore> {
        let weights = s
            .run
            .objective
            .ref_weights(s.reference.clone())
            .context("train.precompute_ref without a reference")?;
        let (mine, at) = plan(d, d.total_steps()?, s.comm.rank())?;
        let n: usize = at.values().map(|&(_, n)| n).sum();
        let key = pref_store::key(s, d)?;
        let file = pref_store::path(out_dir);
        let (lead, world) = (s.comm.rank() == 0, s.comm.world());
        let read = match lead {
            true => pref_store::read(&file, &key, n),
            false => Err(String::new()),
        };
        // Rank 0 decides: [found] then, when found, its table, summed over the ranks (zeros
        // elsewhere: the sum is rank 0's bits).
        let found = share(s, &[f32::from(u8::from(read.is_ok()))])?[0] > 0.0;
        let kto = s.run.objective.is_kto();
        if found {
            let values = match read {
                Ok(v) => v,
                Err(_) => vec![0f32; n],
            };
            let values = match world {
                1 => values,
                _ => share(s, &values)?,
            };
            if lead {
                crate::errln!(
                    "reference log-probs: {n} sequences read from {} (0 computed)",
                    file.display()
                );
            }
            return Ok(RefStore { at, values, kto });
        }
        let why = read.err().unwrap_or_default();
        let t0 = Instant::now();
        let mut values = vec![0f32; n];
        let rows: usize = mine.iter().map(|(_, m)| m.len()).sum();
        let mut bar = Bar::new(rows as u64, lead);
        let par = s.par(false);
        for (slot, m) in &mine {
            let b = d.batch(m)?;
            let mut v = host(&seq_logps(&s.model, &par, &b, Some(&weights))?)?;
            if kto {
                let Some(kl) = b.pref.as_ref().and_then(|l| l.kl.as_deref()) else {
                    bail!("a KTO micro-batch without its mismatched pairs");
                };
                v.extend(host(&seq_logps(&s.model, &par, kl, Some(&weights))?)?);
            }
            let (off, len) = at.get(slot).copied().unwrap_or_default();
            if v.len() != len {
                bail!(
                    "the reference pass gave {} values for a micro-batch of {len}",
                    v.len()
                );
            }
            values[off..off + len].copy_from_slice(&v);
            bar.inc(m.len() as u64);
        }
        bar.finish();
        let values = match world {
            1 => values,
            _ => share(s, &values)?,
        };
        if lead {
            std::fs::create_dir_all(out_dir)
                .with_context(|| format!("cannot create {}", out_dir.display()))?;
            crate::util::atomic_write(&file, &pref_store::encode(&key, &values))?;
            let secs = t0.elapsed().as_secs_f64();
            crate::errln!(
                "reference log-probs: {n} sequences computed in {secs:.1}s ({:.0} rows/s) → {} (not read: {why})",
                rows as f64 / secs.max(1e-9),
                file.display()
            );
        }
        Ok(RefStore { at, values, kto })
    }

    /// `b` with its stored values in its layout (and KTO's mismatched pairs' in theirs), when
    /// the table has micro-batch `k` of step (`epoch`, `index`) of `rank`; else as it was (the
    /// objective then runs the reference's forward).
    pub(crate) fn attach(&self, b: Batch, slot: Slot) -> Batch {
        let (Some(&(off, len)), Some(l)) = (self.at.get(&slot), b.pref.as_ref()) else {
            return b;
        };
        let Some(v) = self.values.get(off..off + len) else {
            return b;
        };
        let mut l = (**l).clone();
        match self.kto {
            false => l.reference = Some(v.to_vec()),
            true => {
                let (main, kl) = v.split_at(len / 2);
                l.reference = Some(main.to_vec());
                l.kl = l.kl.take().map(|mut klb| {
                    if let Some(kll) = &klb.pref {
                        let mut kll = (**kll).clone();
                        kll.reference = Some(kl.to_vec());
                        klb.pref = Some(Arc::new(kll));
                    }
                    klb
                });
            }
        }
        Batch {
            pref: Some(Arc::new(l)),
            ..b
        }
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec1()?)
}

/// `v` summed over the ranks (itself on one rank).
fn share(s: &Session, v: &[f32]) -> Result<Vec<f32>> {
    if s.comm.world() == 1 {
        return Ok(v.to_vec());
    }
    let t = Tensor::from_slice(v, v.len(), &s.model.device)?;
    host(&s.comm.all_reduce_sum(&t)?)
}

/// The pass's progress: a bar (rows, rows/s, ETA) on a terminal, else a line every
/// `util::bar::LINE_EVERY`.
struct Bar {
    shown: Shown,
    total: u64,
    done: u64,
}

impl Bar {
    fn new(total: u64, show: bool) -> Bar {
        let template = "reference log-probs [{bar:25}] {pos}/{len} rows {per_sec} ETA {eta}";
        Bar {
            shown: Shown::new(total, template, show),
            total,
            done: 0,
        }
    }

    fn inc(&mut self, rows: u64) {
        self.done += rows;
        if let Some(bar) = &self.shown.bar {
            bar.set_position(self.done);
        } else if self.shown.line_due() {
            let secs = self.shown.t0.elapsed().as_secs_f64().max(1e-3);
            let rate = self.done as f64 / secs;
            let eta = (self.total.saturating_sub(self.done)) as f64 / rate.max(1e-9);
            crate::errln!(
                "reference log-probs: {}/{} rows ({rate:.0} rows/s), ETA {eta:.0}s",
                self.done,
                self.total
            );
        }
    }

    fn finish(&self) {
        self.shown.finish();
    }
}
