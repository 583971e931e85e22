//! A bench's side of the training loop (train::run_loop): random rows for every step, and
//! between steps what the same recipe's `train` would do (an eval every N steps, a checkpoint
//! every N steps) plus the clock: a step counts as done once its loss is read and its eval run
//! and checkpoint started, and the timed steps run on from the warm-up ones without a pause.

use super::rows::micro_batches;
use super::{workload, BenchArgs};
use crate::data::Batch;
use crate::model::{routing_reads, Keep};
use crate::train::meter::PhaseMeter;
use crate::train::optim::AdamW;
use crate::train::run_loop::{self, Hooks, PlannedStep, StepMeta};
use crate::train::step::{adapter_params, Done, Engine};
use crate::train::Session;
use anyhow::Result;
use std::time::Instant;

/// What the timed steps measured.
pub(crate) struct Steps {
    pub(crate) clock: workload::Clock,
    /// When the first step was queued.
    pub(crate) t1: Instant,
    /// Seconds the host spent queueing the timed steps' work.
    pub(crate) queue_s: f64,
    /// Seconds starting checkpoints (their host copies), and waiting for the last one's write.
    pub(crate) save_s: f64,
    pub(crate) save_wait_s: f64,
    /// Seconds the MoE routing's reads waited on the device in the timed steps, and how many
    /// reads (`model::routing_reads`).
    pub(crate) route_wait: (f64, u64),
    /// The engine's meter after the timed steps (its run peaks and phase ends).
    pub(crate) meter: PhaseMeter,
}

/// The bench's hooks: its rows, eval batches and checkpoint writer, and the clock.
pub(crate) struct BenchHooks<'a> {
    a: &'a BenchArgs,
    /// This rank's micro-batches of every step.
    batches: Vec<Batch>,
    /// This rank's eval micro-batches.
    pub(crate) evals: Vec<Batch>,
    /// The step's loss denominator over all ranks.
    denom: usize,
    /// The checkpoint writer, and whether this rank writes.
    pub(crate) saver: Option<(workload::Saver, bool)>,
    clock: workload::Clock,
    queue_s: f64,
    save_s: f64,
    save_wait_s: f64,
    /// `model::routing_reads` when the timed steps began.
    route_reads0: (f64, u64),
    /// The session the eval runs on, while the loop runs.
    session: Option<&'a Session>,
}

impl<'a> BenchHooks<'a> {
    /// The rows and writer of rank `s.comm.rank()`.
    pub(crate) fn new(a: &'a BenchArgs, s: &Session) -> Result<BenchHooks<'a>> {
        let (rank, world) = (s.comm.rank(), s.comm.world());
        let (batches, evals) = micro_batches(a, s.run.cfg.vocab_size, rank, world);
        // Every row counts t − pack targets: the step's denominator over all ranks.
        let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
        let denom = world * accum * b * workload::targets_per_row(t, a.pack);
        let saver = match a.save_every {
            0 => None,
            _ => Some((workload::Saver::new(&s.model)?, rank == 0)),
        };
        Ok(BenchHooks {
            a,
            batches,
            evals,
            denom,
            saver,
            clock: workload::Clock::new(a.warmup),
            queue_s: 0.0,
            save_s: 0.0,
            save_wait_s: 0.0,
            route_reads0: (0.0, 0),
            session: None,
        })
    }

    /// The warm-up and timed steps on `s`, keeping `keep` of each layer; on a failure, the
    /// error and the engine's meter (the phase it failed in).
    pub(crate) fn run(
        &mut self,
        s: &'a Session,
        keep: Keep,
    ) -> Result<Steps, (anyhow::Error, PhaseMeter)> {
        let o = &s.run.optim;
        let opt = AdamW::new(adapter_params(&s.model), o.betas, o.eps, o.weight_decay);
        let mut opt = opt.map_err(|e| (e.into(), PhaseMeter::default()))?;
        let mut engine = Engine::for_session(s, keep);
        self.session = Some(s);
        let total = self.a.warmup + self.a.steps;
        let (batches, denom) = (self.batches.clone(), self.denom);
        let mut rows = (0..).map(move |index| {
            Ok(PlannedStep {
                epoch: 0,
                index,
                batches: batches.clone(),
                denom,
            })
        });
        let t1 = Instant::now();
        let res = run_loop::run(&mut engine, &mut opt, &mut rows, (0, total), self);
        self.session = None;
        let (w1, n1) = routing_reads();
        let (w0, n0) = self.route_reads0;
        match res {
            Ok(()) => Ok(Steps {
                route_wait: (w1 - w0, n1.saturating_sub(n0)),
                clock: std::mem::replace(&mut self.clock, workload::Clock::new(0)),
                t1,
                queue_s: self.queue_s,
                save_s: self.save_s,
                save_wait_s: self.save_wait_s,
                meter: engine.meter.clone(),
            }),
            Err(e) => Err((e, engine.meter.clone())),
        }
    }

    /// This rank's micro-batches of a step.
    pub(crate) fn step_batches(&self) -> &[Batch] {
        &self.batches
    }

    /// Whether step `n` (1-based) saves a checkpoint.
    fn saves(&self, n: usize) -> bool {
        self.a.save_every > 0 && n % self.a.save_every == 0
    }
}

impl Hooks for BenchHooks<'_> {
    fn lr(&self, _step: usize) -> f64 {
        super::LR
    }

    /// A step that saves is read first, as `train` does; so is the last warm-up step, whose
    /// read opens the timed window: read before the first timed step is queued, or a host that
    /// blocks while it queues (e.g. on parked inputs at long T) would open the window late.
    fn finish_first(&self, n: usize) -> bool {
        self.saves(n) || (n == self.a.warmup && n > 0)
    }

    /// The timed steps' phase peaks are their own.
    fn before(&mut self, engine: &mut Engine, step: usize) {
        if step == self.a.warmup {
            engine.meter = PhaseMeter::default();
            self.route_reads0 = routing_reads();
        }
    }

    /// What `train` does after step `n`: eval, then the checkpoint; the last step also waits
    /// for the checkpoint write in flight: the clock counts them all.
    fn after(&mut self, done: Done, m: &StepMeta, opt: &AdamW) -> Result<()> {
        let n = m.n;
        if let (true, Some(s)) = (
            self.a.eval_every > 0 && n % self.a.eval_every == 0,
            self.session,
        ) {
            workload::eval(&s.model, &s.par(false), &self.evals)?;
        }
        if let (true, Some((saver, true)), Some(s)) = (self.saves(n), &self.saver, self.session) {
            let t0 = Instant::now();
            saver.save(n, &s.model, &s.run.spec, opt)?;
            self.save_s += t0.elapsed().as_secs_f64();
        }
        if let (Some((saver, _)), true) = (&self.saver, n == self.a.warmup + self.a.steps) {
            let t0 = Instant::now();
            saver.wait()?;
            self.save_wait_s = t0.elapsed().as_secs_f64();
        }
        self.clock.record(done);
        Ok(())
    }

    /// Seconds the host spent queueing the timed steps' work (forward, backward, update):
    /// near step_s, the host sets the pace (launches, allocations, routing reads), not the
    /// device.
    fn queued(&mut self, step: usize, seconds: f64) {
        if step >= self.a.warmup {
            self.queue_s += seconds;
        }
    }
}
