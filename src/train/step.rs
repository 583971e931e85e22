//! The step engine: one optimiser step of `grad_accum` micro-batches, the same code for
//! `train`, `bench` and `probe`.
//!
//! A step is three calls, so that the host never holds the device up:
//! 1. `backward`: every micro-batch's forward and backward queued (train::driver), the adapter
//!    gradients summed over the ranks, the step's Σ CE (and, with several ranks, its counted
//!    tokens) summed too, and the clipping and finite check made on the device
//!    (`optim::clip_step`); the step's scalars start their way to the host (train::readback).
//! 2. `update`: the AdamW update queued right behind (the fused kernel skips a step found not
//!    finite on the device, with no host round trip).
//! 3. `finish`: the scalars read — a wait for their copy alone, which has long landed when the
//!    caller queued the next step's `backward` first: the loss, ‖g‖, whether the step was
//!    finite (if not, the optimiser's step counter is taken back: the kernel skipped it).
//!
//! Callers run step k+1's `backward` before step k's `finish`, and step k's `finish` before
//! step k+1's `update`, so that whatever the host does with step k (log, eval, checkpoint)
//! still sees step k's adapters, and a step found not finite stops the run before another
//! update follows it.

use super::comm::Comm;
use super::driver::{self, Par};
use super::meter::PhaseMeter;
use super::objective::{Objective, Sft};
use super::optim::{self, AdamW, Grads, StepClip};
use super::readback::{Readbacks, Ticket};
use super::session::Session;
use crate::data::Batch;
use crate::model::{Keep, Model};
use crate::train::shards::Shards;
use anyhow::Result;
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// One rank's engine: its model (FSDP: with its shards), communicator and step settings.
pub struct Engine<'a> {
    model: &'a Model,
    comm: &'a dyn Comm,
    shards: Option<&'a Shards>,
    keep: Keep,
    max_grad_norm: f64,
    /// Dropout masks are keyed by (seed, step, micro-batch): None without dropout.
    dropout_seed: Option<u64>,
    /// The adapters in the optimiser's order (`adapter_params`): the gradient norm's sum order.
    order: Vec<candle_core::Var>,
    rb: Readbacks,
    /// What the head's loss is.
    objective: Box<dyn Objective>,
    /// The phase each step is in and the device pool's peak per phase.
    pub(crate) meter: PhaseMeter,
}

/// A step's forward and backward queued, its update not yet.
pub(crate) struct Queued {
    grads: Grads,
    clip: StepClip,
    read: Reading,
}

/// A step whose update is queued; `finish` reads what it did.
pub(crate) struct Pending {
    read: Reading,
    clip: StepClip,
    /// The optimiser's step counter advanced for it (`AdamW::step_clip`).
    counted: bool,
    peaks: BTreeMap<&'static str, u64>,
}

/// A step's scalars on their way to the host.
struct Reading {
    /// [Σ CE, tokens] over every rank (several ranks), [Σ CE] (one rank, something counted),
    /// or nothing; then a device clip's [‖g‖, coef, skip].
    vals: Option<Ticket>,
    counted: Counted,
    denom: usize,
    /// This rank's tokens (padding excluded).
    tokens: usize,
    /// The objective's metrics of the step (`Objective::end_step`).
    metrics: Vec<(&'static str, f64)>,
}

enum Counted {
    Sums,
    Ce,
    Nothing,
}

/// What the host learns of a finished step.
#[derive(Debug, Clone)]
pub struct Done {
    /// The step's loss: SFT's mean token cross-entropy over the step's counted tokens (every
    /// rank's); a preference objective's over the step's pairs.
    pub loss: f64,
    pub(crate) grad_norm: f64,
    /// The loss and every gradient were finite, so the update was applied.
    pub(crate) finite: bool,
    /// Tokens of the step over every rank (padding excluded).
    pub(crate) tokens: usize,
    /// Counted (target) tokens of the step over every rank: the loss's denominator.
    pub(crate) denom: usize,
    /// The device pool's peak in each phase of the step (empty on the CPU).
    pub(crate) peaks: BTreeMap<&'static str, u64>,
    /// The objective's metrics beside the loss (TRL's names: `rewards/chosen`, ...), over
    /// the step's micro-batches and ranks; empty for SFT.
    pub(crate) metrics: Vec<(&'static str, f64)>,
}

impl<'a> Engine<'a> {
    /// The engine of a session's rank as its run says (clipping, dropout's seed, the
    /// objective), keeping `keep` of each layer (`RunConfig::keep` with the preflight's parked
    /// pairs).
    pub(crate) fn for_session(s: &'a Session, keep: Keep) -> Engine<'a> {
        let run = &s.run;
        let mut e = Engine::new(
            &s.model,
            &*s.comm,
            s.shards.as_ref(),
            keep,
            run.optim.max_grad_norm,
            run.dropout_seed(),
        );
        e.objective = run.objective.objective(s.reference.clone());
        e
    }

    /// An engine of SFT on `model` (tests and tools; runs take `for_session`).
    pub fn new(
        model: &'a Model,
        comm: &'a dyn Comm,
        shards: Option<&'a Shards>,
        keep: Keep,
        max_grad_norm: f64,
        dropout_seed: Option<u64>,
    ) -> Engine<'a> {
        Engine {
            model,
            comm,
            shards,
            keep,
            max_grad_norm,
            dropout_seed,
            order: adapter_params(model),
            rb: Readbacks::new(),
            objective: Box::new(Sft::default()),
            meter: PhaseMeter::default(),
        }
    }

    /// Queues step `step`'s forward and backward over this rank's `batches` (its micro-batches)
    /// and the clipping. `denom`: the step's counted tokens over every rank, so that the ranks'
    /// summed gradients are those of one big batch.
    pub(crate) fn backward(
        &mut self,
        batches: &[Batch],
        denom: usize,
        step: usize,
    ) -> Result<Queued> {
        let dev = &self.model.device;
        let (rank, world) = (self.comm.rank(), self.comm.world());
        let mut grads = Grads::new();
        let mut ce: Option<Tensor> = None;
        self.meter.begin(dev)?;
        self.objective
            .begin_step(self.model, &self.par(true), batches)?;
        for (k, b) in batches.iter().enumerate() {
            // Keyed by the global micro-batch index: a row draws the same mask whatever the
            // number of ranks.
            let micro = k * world + rank;
            let key = self.dropout_seed.map(|s| (s, [step as u64, micro as u64]));
            let par = Par {
                comm: self.comm,
                shards: self.shards,
                reduce: k + 1 == batches.len(),
            };
            let meter = &mut self.meter;
            let c = driver::forward_backward_dev(
                self.model,
                &par,
                b,
                denom.max(1) as f64,
                self.keep,
                key,
                &mut grads,
                &*self.objective,
                &mut |phase| meter.end(dev, phase),
            )?;
            ce = driver::add_ce(ce, c)?;
        }
        let metrics = self.objective.end_step(self.comm, self.model)?;
        self.meter.done = Some("backward");
        let tokens: usize = batches.iter().map(|b| b.tokens).sum();
        // The step's Σ CE and tokens over every rank (for the loss, its finite check and the
        // log), summed on the device.
        let sums = match world {
            1 => None,
            _ => {
                let local = Tensor::cat(
                    &[
                        match &ce {
                            Some(c) => c.to_dtype(DType::F64)?.reshape(1)?,
                            None => Tensor::zeros(1, DType::F64, dev)?,
                        },
                        Tensor::new(&[tokens as f64], dev)?,
                    ],
                    0,
                )?;
                Some(self.comm.all_reduce_sum(&local)?)
            }
        };
        let ce_all = match &sums {
            Some(s) => Some(s.narrow(0, 0, 1)?.to_dtype(DType::F32)?.squeeze(0)?),
            None => ce,
        };
        let clip = optim::clip_step(&grads, &self.order, self.max_grad_norm, ce_all.as_ref())?;
        let (parts, counted) = match (&sums, &ce_all) {
            (Some(s), _) => (vec![s], Counted::Sums),
            (None, Some(c)) => (vec![c], Counted::Ce),
            (None, None) => (vec![], Counted::Nothing),
        };
        let parts: Vec<&Tensor> = parts.into_iter().chain(clip.on_device()).collect();
        let vals = match parts.is_empty() {
            true => None,
            false => Some(self.rb.start(&parts)?),
        };
        Ok(Queued {
            grads,
            clip,
            read: Reading {
                vals,
                counted,
                denom,
                tokens,
                metrics,
            },
        })
    }

    fn par(&self, reduce: bool) -> Par<'a> {
        Par {
            comm: self.comm,
            shards: self.shards,
            reduce,
        }
    }

    /// Queues the step's AdamW update at learning rate `lr`.
    pub(crate) fn update(&mut self, q: Queued, opt: &mut AdamW, lr: f64) -> Result<Pending> {
        let counted = opt.step_clip(&q.grads, lr, &q.clip)?;
        self.meter.end(&self.model.device, "optimizer")?;
        drop(q.grads);
        Ok(Pending {
            read: q.read,
            clip: q.clip,
            counted,
            peaks: self.meter.take(),
        })
    }

    /// Reads what a pending step did. A step found not finite had its update skipped on the
    /// device: the optimiser's step counter is taken back here.
    pub(crate) fn finish(&mut self, p: Pending, opt: &mut AdamW) -> Result<Done> {
        let r = p.read;
        let v = match r.vals {
            Some(t) => self.rb.read(t)?,
            None => Vec::new(),
        };
        // A value missing reads as NaN: the step then counts as not finite.
        let mut v = v.into_iter();
        let mut next = || v.next().unwrap_or(f64::NAN);
        let (ce, tokens) = match r.counted {
            Counted::Sums => (next(), next() as usize),
            Counted::Ce => (next(), r.tokens),
            Counted::Nothing => (0.0, r.tokens),
        };
        let (grad_norm, finite) = p.clip.from_vals(&[next(), next(), next()]);
        let loss = ce / r.denom.max(1) as f64;
        let finite = finite && loss.is_finite();
        if !finite && p.counted {
            opt.untake();
        }
        Ok(Done {
            loss,
            grad_norm,
            finite,
            tokens,
            denom: r.denom,
            peaks: p.peaks,
            metrics: r.metrics,
        })
    }

    /// One whole step at once (probe: nothing to overlap with).
    pub fn step(
        &mut self,
        batches: &[Batch],
        denom: usize,
        step: usize,
        opt: &mut AdamW,
        lr: f64,
    ) -> Result<Done> {
        let q = self.backward(batches, denom, step)?;
        let p = self.update(q, opt, lr)?;
        self.finish(p, opt)
    }
}

/// The model's trainable tensors, A, B (and DoRA's m) of each adapter in the model's order:
/// the optimiser's parameters, and the order of every sum over them.
pub fn adapter_params(model: &Model) -> Vec<candle_core::Var> {
    model
        .adapters()
        .flat_map(|(_, l)| l.vars().into_iter().cloned())
        .collect()
}
