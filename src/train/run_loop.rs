//! The one training loop of `train`, `bench` and `probe`: steps from a batch source run one
//! ahead of the host, what each caller does between steps behind `Hooks`.
//!
//! Step k+1's forward and backward are queued before the host reads step k's loss and does
//! what step k asks (log, eval, checkpoint, stop, a clock), and step k+1's update is queued
//! only after that, so the device never idles while the host reads, step k's eval and
//! checkpoint see step k's adapters, and a step found not finite stops the run (or is counted
//! as skipped: the update kernel skipped it) before another update follows it. A step the hooks
//! want finished first (`Hooks::finish_first`: one that saves a checkpoint, or bench's last
//! warm-up step) is read before the next is queued.

use super::meter::PhaseMeter;
use super::optim::AdamW;
use super::step::{Done, Engine, Pending};
use crate::data::Batch;
use anyhow::Result;
use std::time::Instant;

/// One step of a batch source: this rank's micro-batches and where they sit in the data.
pub struct PlannedStep {
    /// The epoch the step belongs to.
    pub(crate) epoch: usize,
    /// The step's index in its epoch's plan (0-based).
    pub(crate) index: usize,
    /// This rank's micro-batches.
    pub batches: Vec<Batch>,
    /// Counted tokens of the step over every rank: its loss denominator.
    pub denom: usize,
}

/// A queued step as the hooks see it once it is done.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepMeta {
    /// The step's 1-based number in the run.
    pub(crate) n: usize,
    /// Its epoch and its index in the epoch's plan.
    pub(crate) epoch: usize,
    pub(crate) index: usize,
    /// The learning rate its update took.
    pub(crate) lr: f64,
}

/// What a loop's caller does with its steps beside running them.
pub(crate) trait Hooks {
    /// The learning rate of step `step` (0-based).
    fn lr(&self, step: usize) -> f64;

    /// Whether step `n` (1-based, its update queued) is read before the next step is queued.
    fn finish_first(&self, n: usize) -> bool;

    /// Before step `step` (0-based) is queued.
    fn before(&mut self, _engine: &mut Engine, _step: usize) {}

    /// Step `meta.n` is done (its loss read): log, eval, checkpoint, stop (an error ends the
    /// loop: `stop::Interrupted` for a signal).
    fn after(&mut self, done: Done, meta: &StepMeta, opt: &AdamW) -> Result<()>;

    /// A failure of step `step`'s (0-based) device work, as the run reports it.
    fn fail(&self, e: anyhow::Error, _meter: &PhaseMeter, _step: usize) -> anyhow::Error {
        e
    }

    /// The seconds the host spent queueing step `step`'s (0-based) forward, backward and
    /// update.
    fn queued(&mut self, _step: usize, _seconds: f64) {}
}

/// Runs steps `first` to `total` (0-based, end excluded) of `steps` on `engine` and `opt`.
pub(crate) fn run(
    engine: &mut Engine,
    opt: &mut AdamW,
    steps: &mut dyn Iterator<Item = Result<PlannedStep>>,
    (first, total): (usize, usize),
    hooks: &mut dyn Hooks,
) -> Result<()> {
    let mut queued = first;
    let mut pending: Option<(Pending, StepMeta)> = None;
    loop {
        // ---- the next step's forward and backward, queued (after the step before, when the
        // hooks want it read first)
        let eager = pending.is_some() && hooks.finish_first(queued);
        let next = match eager || queued >= total {
            true => None,
            false => steps.next().transpose()?,
        };
        let t0 = Instant::now();
        let work = match next {
            Some(st) => {
                hooks.before(engine, queued);
                let q = engine.backward(&st.batches, st.denom, queued);
                let q = q.map_err(|e| hooks.fail(e, &engine.meter, queued))?;
                let meta = StepMeta {
                    n: queued + 1,
                    epoch: st.epoch,
                    index: st.index,
                    lr: hooks.lr(queued),
                };
                Some((q, meta))
            }
            None => None,
        };
        let queue_s = t0.elapsed().as_secs_f64();
        // ---- what the host does with the step before (its device work is done or queued)
        if let Some((p, meta)) = pending.take() {
            let done = engine.finish(p, opt)?;
            hooks.after(done, &meta, opt)?;
        }
        // ---- the queued step's update
        let Some((q, meta)) = work else {
            if eager {
                continue;
            }
            break;
        };
        let t0 = Instant::now();
        let p = engine.update(q, opt, meta.lr);
        let p = p.map_err(|e| hooks.fail(e, &engine.meter, queued))?;
        hooks.queued(queued, queue_s + t0.elapsed().as_secs_f64());
        pending = Some((p, meta));
        queued += 1;
    }
    Ok(())
}
