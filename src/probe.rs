//! `lora-train probe`: the smoke ramp. One full training step (forward, head, backward,
//! optimizer: train::step's engine, as training runs it) at micro-batch 1 and seq 64, then seq
//! doubling up to the recipe's seq_len, then micro-batch doubling, each with the device pool's
//! peak per phase, until the first allocation failure: the knee (the last shape that ran) and
//! the phase that broke.
//!
//! The context ramp (`Ramp::Seq`, `probe --max-seq N`) stays at micro-batch 1 and doubles seq
//! past the recipe's seq_len up to N; after the first failure it bisects between the knee and
//! the failure (`refine` times, at multiples of 64 tokens), so the knee is the longest context
//! the card holds to within a fraction of the last doubling.
//!
//! The model is the recipe's (weights loaded, adapters fresh); the data are random token ids
//! of each shape (the memory of a step depends on the shapes only). On the CPU there are no
//! device peaks: the ramp reports times, and `train.max_memory` caps the CPU accounting.

use crate::memory::{self, plan, plan::fmt_bytes};
use crate::model::Keep;
use crate::ops::pool;
use crate::recipe::Recipe;
use crate::run::Machine;
use crate::train::optim::AdamW;
use crate::train::run_loop::{self, Hooks, PlannedStep, StepMeta};
use crate::train::step::{adapter_params, Done, Engine};
use crate::train::Solo;
use crate::train::{RunConfig, Session};
use anyhow::Result;
use std::sync::Arc;
use std::time::Instant;

/// One rung of the ramp.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Rung {
    pub(crate) micro_batch: usize,
    pub(crate) seq: usize,
    pub(crate) seconds: f64,
    /// The pool's peak in each phase (bytes; empty on the CPU).
    pub(crate) peaks: std::collections::BTreeMap<&'static str, u64>,
    /// Pairs of parked gate and up in flight (the MLP half checkpointed on CUDA; else 0).
    pub(crate) park_pending: usize,
}

/// Where the ramp stopped.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Failure {
    pub(crate) micro_batch: usize,
    pub(crate) seq: usize,
    pub(crate) phase: &'static str,
    pub(crate) cause: String,
}

/// What a probe found: each rung that ran, the first failure, and the memory measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeReport {
    pub(crate) rungs: Vec<Rung>,
    /// The first allocation failure (None: the whole ramp ran).
    pub(crate) oom: Option<Failure>,
    /// The device pool's peak after loading (CUDA).
    pub(crate) load_peak: Option<u64>,
    pub(crate) capacity: Option<u64>,
}

/// Which ramp a probe runs.
#[derive(Debug, Clone, Copy)]
pub enum Ramp {
    /// seq doubling up to the recipe's seq_len, then micro-batch doubling up to this.
    Batch {
        /// The largest micro-batch tried.
        max_micro_batch: usize,
    },
    /// seq doubling at micro-batch 1 up to `max_seq`, then `refine` bisection steps.
    Seq {
        /// The longest seq tried.
        max_seq: usize,
        /// Bisection steps between the last seq that fit and the first that did not.
        refine: usize,
    },
}

/// The seq rungs of the bisection run at multiples of this.
pub(crate) const SEQ_GRAIN: usize = 64;

/// The context ramp's first shapes: seq doubling from 64 (or `max_seq`) up to `max_seq`.
pub(crate) fn seq_ramp(max_seq: usize) -> Vec<(usize, usize)> {
    ramp(max_seq, 1)
}

/// The next rung of the bisection between a seq that ran (`lo`) and one that failed (`hi`):
/// their midpoint at a multiple of `SEQ_GRAIN`, None when no such point lies between them.
pub(crate) fn bisect(lo: usize, hi: usize) -> Option<usize> {
    let mid = (lo + hi) / 2 / SEQ_GRAIN * SEQ_GRAIN;
    (mid > lo && mid < hi).then_some(mid)
}

/// The ramp's shapes: (micro-batch, seq).
pub(crate) fn ramp(seq_len: usize, max_micro_batch: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut t = 64.min(seq_len);
    while t < seq_len {
        out.push((1, t));
        t *= 2;
    }
    out.push((1, seq_len));
    let mut b = 2;
    while b <= max_micro_batch {
        out.push((b, seq_len));
        b *= 2;
    }
    out
}

/// The pairs of parked gate and up in flight at each shape (the MLP half checkpointed with
/// offload), fitted as `train`'s preflight fits them: within train.max_memory, else the
/// card's free memory before the load; none where the host could not pin them.
struct ParkFit {
    input: plan::PlanInput,
    capacity: Option<u64>,
    ckpt: crate::recipe::Checkpointing,
}

impl ParkFit {
    fn new(run: &RunConfig, dev: &candle_core::Device) -> Result<ParkFit> {
        let capacity = match run.max_memory {
            Some(m) => Some(m),
            None => pool::mem_info(dev)?.map(|(free, _)| free + plan::CONTEXT),
        };
        Ok(ParkFit {
            input: run.plan_input(1),
            capacity,
            ckpt: run.ckpt,
        })
    }

    /// At (micro_batch, seq), with `host_available` bytes of host memory (None: unknown).
    fn pending(&self, micro_batch: usize, seq: usize, host_available: Option<u64>) -> usize {
        let at = plan::PlanInput {
            micro_batch,
            seq_len: seq,
            ..self.input.clone()
        };
        let single = crate::recipe::Strategy::Single;
        let b = plan::breakdown_within(&at, single, self.ckpt, micro_batch, self.capacity);
        match host_available {
            Some(avail) if !memory::host_fits(b.host, 1, avail) => 0,
            _ => b.park_pending,
        }
    }
}

/// The ramp on the recipe's model: a rung for each shape that ran, and the first allocation
/// failure (on the context ramp, the shortest one the bisection met). The model is the
/// recipe's as training loads it (its kernels, the adapters' forward folded), with fresh
/// adapters and no dropout (the probe draws none).
pub fn run(recipe: &Recipe, ramp: Ramp) -> Result<ProbeReport> {
    let mut r = recipe.clone();
    (r.lora.dropout, r.lora.init_adapter, r.lora.use_dora) = (0.0, None, false);
    let run = Arc::new(RunConfig::resolve(r, Machine::Open)?);
    let ordinal = run.first_ordinal();
    let dev = crate::model::device::open(run.device, ordinal)?;
    pool::keep_pool_memory(&dev)?;
    let park = ParkFit::new(&run, &dev)?;
    let max_memory = run.max_memory;
    let ballast = match max_memory {
        Some(m) => memory::hold_ballast(&dev, m)?,
        None => None,
    };
    let capacity = max_memory.or(ballast.as_ref().map(|b| b.total));
    pool::reset_peak(&dev)?;
    let s = Session::load(run, Box::new(Solo), ordinal)?;
    let load_peak = pool::stats(&s.model.device)?.map(|m| m.used_high);
    let params = adapter_params(&s.model);
    pool::set_cpu_budget(
        max_memory.filter(|_| dev.is_cpu()),
        crate::train::meter::cpu_fixed_bytes(&s.model),
    );
    let o = &s.run.optim;
    let mut trial = Trial {
        s: &s,
        opt: AdamW::new(params, o.betas, o.eps, o.weight_decay)?,
        keep: s.run.keep,
        park: &park,
    };
    let mut rep = ProbeReport {
        rungs: Vec::new(),
        oom: None,
        load_peak,
        capacity,
    };
    let shapes = match ramp {
        Ramp::Batch { max_micro_batch } => self::ramp(s.run.batch.seq_len, max_micro_batch),
        Ramp::Seq { max_seq, .. } => seq_ramp(max_seq),
    };
    trial.climb(shapes, &mut rep)?;
    if let Ramp::Seq { refine, .. } = ramp {
        trial.narrow(refine, &mut rep)?;
    }
    pool::set_cpu_budget(None, 0);
    drop(ballast);
    Ok(rep)
}

/// What each rung's step runs on: the session, its optimiser and how it keeps activations.
struct Trial<'a> {
    s: &'a Session,
    opt: AdamW,
    /// The run's; the parked pairs in flight are fitted at each shape (`park`).
    keep: Keep,
    park: &'a ParkFit,
}

/// A rung's hooks: one step at learning rate 0 (the adapters stay), its result kept.
#[derive(Default)]
struct OneStep {
    done: Option<Done>,
}

impl Hooks for OneStep {
    fn lr(&self, _step: usize) -> f64 {
        0.0
    }

    fn finish_first(&self, _n: usize) -> bool {
        false
    }

    fn after(&mut self, done: Done, _m: &StepMeta, _opt: &AdamW) -> Result<()> {
        self.done = Some(done);
        Ok(())
    }
}

impl Trial<'_> {
    /// One full step at (micro-batch, seq): its rung, or the failure that an allocation ended.
    fn shape(&mut self, b: usize, seq: usize) -> Result<std::result::Result<Rung, Failure>> {
        let batch = crate::bench::random_batch(b, seq, self.s.model.cfg.vocab_size, 7);
        let denom = batch.n_targets().max(1);
        // The training step itself (train::run_loop), at learning rate 0: the adapters stay.
        let pending = self.park.pending(b, seq, memory::host_available());
        let keep = self.keep.with_park(Some(pending));
        let mut engine = Engine::for_session(self.s, keep);
        let step = PlannedStep {
            epoch: 0,
            index: 0,
            batches: vec![batch],
            denom,
        };
        let mut one = OneStep::default();
        let t0 = Instant::now();
        let res = run_loop::run(
            &mut engine,
            &mut self.opt,
            &mut std::iter::once(Ok(step)),
            (0, 1),
            &mut one,
        );
        match (res, one.done) {
            (Ok(()), Some(done)) => Ok(Ok(Rung {
                micro_batch: b,
                seq,
                seconds: t0.elapsed().as_secs_f64(),
                peaks: done.peaks,
                park_pending: match keep {
                    Keep::ParkMlp { pending, .. } => pending,
                    _ => 0,
                },
            })),
            (Err(e), _) if pool::is_oom(&e) => Ok(Err(Failure {
                micro_batch: b,
                seq,
                phase: engine.meter.current(),
                cause: format!("{e:#}").lines().next().unwrap_or("").to_string(),
            })),
            (Err(e), _) => Err(e),
            (Ok(()), None) => anyhow::bail!("probe: the step at ({b}, {seq}) was not read"),
        }
    }

    /// `rep` with a rung for each of `shapes` in turn, up to the first failure.
    fn climb(&mut self, shapes: Vec<(usize, usize)>, rep: &mut ProbeReport) -> Result<()> {
        for (b, seq) in shapes {
            match self.shape(b, seq)? {
                Ok(r) => rep.rungs.push(r),
                Err(f) => {
                    rep.oom = Some(f);
                    break;
                }
            }
        }
        Ok(())
    }

    /// The context ramp's last doubling narrowed: up to `refine` bisection steps at
    /// micro-batch 1 between the knee and the failure, the failure kept the shortest one.
    /// Nothing where the ramp did not fail.
    fn narrow(&mut self, refine: usize, rep: &mut ProbeReport) -> Result<()> {
        let Some(f) = &rep.oom else { return Ok(()) };
        let (mut lo, mut hi) = (rep.knee().map_or(0, |k| k.seq), f.seq);
        for _ in 0..refine {
            let Some(mid) = bisect(lo, hi) else { break };
            match self.shape(1, mid)? {
                Ok(r) => {
                    lo = mid;
                    rep.rungs.push(r);
                }
                Err(f) => {
                    hi = mid;
                    rep.oom = Some(f);
                }
            }
        }
        Ok(())
    }
}

impl ProbeReport {
    /// The last shape that ran.
    pub(crate) fn knee(&self) -> Option<&Rung> {
        self.rungs.last()
    }

    /// The report as the table `probe` prints.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "probe: one full step per shape on random token ids (forward, head, backward, optimizer)\n",
        );
        if let Some(l) = self.load_peak {
            out.push_str(&format!("after load: {}\n", fmt_bytes(l)));
        }
        if let Some(c) = self.capacity {
            out.push_str(&format!("capacity: {}\n", fmt_bytes(c)));
        }
        out.push_str("micro_batch      seq   seconds  peak per phase\n");
        for r in &self.rungs {
            let peaks = if r.peaks.is_empty() {
                "(not measured on the CPU)".to_string()
            } else {
                crate::train::meter::PHASES
                    .iter()
                    .filter_map(|p| r.peaks.get(p).map(|v| format!("{p} {}", fmt_bytes(*v))))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push_str(&format!(
                "{:>11} {:>8} {:>9.3}  {peaks}\n",
                r.micro_batch, r.seq, r.seconds
            ));
        }
        match (&self.oom, self.knee()) {
            (Some(f), knee) => {
                out.push_str(&format!(
                    "out of memory at micro-batch {} × seq {} in the {} phase: {}\n",
                    f.micro_batch, f.seq, f.phase, f.cause
                ));
                match knee {
                    Some(k) => out.push_str(&format!(
                        "knee: micro-batch {} × seq {} is the largest shape that ran\n",
                        k.micro_batch, k.seq
                    )),
                    None => out.push_str("knee: none (the first shape already failed)\n"),
                }
            }
            (None, Some(k)) => out.push_str(&format!(
                "no out-of-memory up to micro-batch {} × seq {}\n",
                k.micro_batch, k.seq
            )),
            (None, None) => {}
        }
        out
    }

    /// The report as JSON (`probe --json`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["knee"] = serde_json::to_value(self.knee()).unwrap_or_default();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rung gets the pairs of parked gate and up that `train`'s preflight would fit at
    /// its shape: a smaller micro-batch leaves room for more; none where not one fits, or
    /// where the host could not pin them.
    #[test]
    fn parked_pairs_are_fitted_at_each_rung() {
        use crate::model::PARK_PENDING;
        use crate::recipe::{Checkpointing, Strategy};
        let all = crate::model::ALL_LINEAR.iter().map(|s| s.to_string());
        let input = plan::input_from_shape("llama2-7b", 2048, 2, 16, all.collect(), 1).unwrap();
        let mlp = Checkpointing::Mlp;
        let total = |offload, b| {
            let p = plan::PlanInput {
                offload,
                ..input.clone()
            };
            plan::breakdown(&p, Strategy::Single, mlp, b).total
        };
        let (most, none) = (total(true, 2), total(false, 2));
        let fit = |capacity| ParkFit {
            input: input.clone(),
            capacity,
            ckpt: mlp,
        };
        assert_eq!(fit(None).pending(2, 2048, None), PARK_PENDING);
        let between = fit(Some(none + (most - none) / 3));
        let two = between.pending(2, 2048, None);
        assert!((1..PARK_PENDING).contains(&two), "{two}");
        assert_eq!(between.pending(1, 2048, None), PARK_PENDING);
        assert_eq!(fit(Some(none)).pending(2, 2048, None), 0);
        // gate and up of 29 layers at 2 × 2048 tokens: 5.2 GB pinned, over 3/4 of 4 GiB
        assert_eq!(fit(None).pending(2, 2048, Some(4 << 30)), 0);
        assert_eq!(fit(None).pending(2, 2048, Some(64 << 30)), PARK_PENDING);
        // other checkpointing parks no pairs
        let whole = ParkFit {
            ckpt: Checkpointing::Full,
            ..fit(None)
        };
        assert_eq!(whole.pending(2, 2048, None), 0);
    }

    #[test]
    fn ramp_doubles_seq_then_micro_batch() {
        assert_eq!(
            ramp(512, 8),
            vec![
                (1, 64),
                (1, 128),
                (1, 256),
                (1, 512),
                (2, 512),
                (4, 512),
                (8, 512)
            ]
        );
        // seq_len not a power of two: the last rung is seq_len itself.
        assert_eq!(super::ramp(100, 2), vec![(1, 64), (1, 100), (2, 100)]);
        assert_eq!(super::ramp(32, 1), vec![(1, 32)]);
    }

    #[test]
    fn the_context_ramp_doubles_seq_at_micro_batch_one_then_bisects() {
        assert_eq!(
            super::seq_ramp(1000),
            vec![(1, 64), (1, 128), (1, 256), (1, 512), (1, 1000)]
        );
        // Between a seq that ran and one that failed, at multiples of 64.
        assert_eq!(super::bisect(262_144, 524_288), Some(393_216));
        assert_eq!(super::bisect(128, 256), Some(192));
        // 224 is no multiple of 64: nothing lies between.
        assert_eq!(super::bisect(192, 256), None);
        assert_eq!(super::bisect(128, 384), Some(256));
        assert_eq!(super::bisect(0, 64), None);
    }
}
