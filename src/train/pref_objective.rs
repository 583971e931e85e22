//! The preference objectives at the head (DPO, ORPO, SimPO, KTO): the policy's log-probability
//! of every target and its gradient from the head in one pass, summed per sequence, the loss
//! and dL/d(each sum) from `pref_loss` / `kto_loss` on the host, each target's gradient row
//! weighed by dL/d(its log-probability).
//!
//! The step's loss is the mean over the step's pairs (KTO: examples) on every rank, each
//! micro-batch weighing its share (TRL's mean over a micro-batch, which equals it for full
//! micro-batches); ORPO's NLL is the token mean over the step's scored chosen tokens; KTO's KL
//! estimate the mean over the step's mismatched pairs (TRL: over the micro-batch, gathered over
//! the ranks). So the ranks and gradient accumulation never change the maths. The step-wide
//! counts (and KTO's KL) are taken before the step's first micro-batch (`begin_step`).

use super::comm::Comm;
use super::driver::Par;
use super::kto_loss::{kto_loss, KtoLogps};
use super::objective::{HeadIn, HeadOut, Objective, ObjectiveKind};
use super::pref_loss::{pair_loss, Metric, PairLogps, PairObjective};
use super::pref_ref::{seq_logps, RefWeights};
use super::sizes::head_chunk_rows;
use crate::data::pref_batch::PrefLayout;
use crate::data::Batch;
use crate::model::Model;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::sync::Mutex;

/// A preference objective of one rank's engine.
pub struct Pref {
    kind: ObjectiveKind,
    /// The reference's weights (DPO, KTO).
    weights: Option<RefWeights>,
    step: Mutex<StepState>,
}

/// What the step's micro-batches share.
#[derive(Default)]
struct StepState {
    /// Pairs (KTO: examples) of the step over every rank.
    units: f64,
    /// ORPO: the NLL's scored chosen tokens of the step over every rank.
    nll_tokens: f64,
    /// KTO: the step's KL estimate (not yet clamped).
    kl: f64,
    /// The metrics so far: (name, Σ over micro-batches, micro-batches).
    metrics: Vec<(&'static str, f64, f64)>,
}

/// The metrics each objective reports, in TRL's order.
fn metric_names(kind: ObjectiveKind) -> &'static [&'static str] {
    const PAIR: &[&str] = &[
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ];
    const ORPO: &[&str] = &[
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
        "log_odds_ratio",
        "log_odds_chosen",
    ];
    const SIMPO: &[&str] = &[
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
    ];
    const KTO: &[&str] = &[
        "kl",
        "rewards/chosen",
        "logps/chosen",
        "rewards/rejected",
        "logps/rejected",
        "rewards/margins",
    ];
    match kind {
        ObjectiveKind::Pair {
            loss: PairObjective::Orpo { .. },
            ..
        } => ORPO,
        ObjectiveKind::Pair {
            loss: PairObjective::Simpo { .. },
            ..
        } => SIMPO,
        ObjectiveKind::Kto { .. } => KTO,
        _ => PAIR,
    }
}

fn layout(batch: &Batch) -> Result<&PrefLayout> {
    match &batch.pref {
        Some(l) => Ok(l),
        None => bail!("a preference objective was given a batch without its pairs' layout"),
    }
}

/// Every other value of `v` from `start`.
fn every_other<T: Copy>(v: &[T], start: usize) -> Vec<T> {
    v.iter().skip(start).step_by(2).copied().collect()
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1()
}

fn cpu(v: &[f64]) -> Result<Tensor> {
    Tensor::new(v, &Device::Cpu)
}

/// ORPO's scored chosen tokens of a pair layout: each chosen completion and its prompt but
/// the prompt's first token.
fn nll_tokens(l: &PrefLayout) -> f64 {
    (0..l.n_seqs())
        .step_by(2)
        .map(|k| (l.completion_len[k] + l.prompt_len[k].saturating_sub(1)) as f64)
        .sum()
}

/// A micro-batch's result as the head uses it: its share of the step's loss, dL/d(each
/// sequence's completion sum), dL/d(each scored prompt token), its metrics.
struct Share {
    loss: f64,
    d_seq: Vec<f64>,
    d_prompt: f64,
    metrics: Vec<Metric>,
}

impl Pref {
    /// The objective `kind` (not SFT), its reference's weights when it has one.
    pub fn new(kind: ObjectiveKind, weights: Option<RefWeights>) -> Pref {
        Pref {
            kind,
            weights,
            step: Mutex::new(StepState::default()),
        }
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, StepState>> {
        self.step
            .lock()
            .map_err(|_| candle_core::Error::Msg("pref objective: a rank panicked".into()))
    }

    /// A pair micro-batch's share of the step.
    fn pair(
        &self,
        obj: PairObjective,
        l: &PrefLayout,
        comp: &[f64],
        prompt: &[f64],
        reference: Option<&[f64]>,
        st: &StepState,
    ) -> Result<Share> {
        let (pc, pr) = (cpu(&every_other(comp, 0))?, cpu(&every_other(comp, 1))?);
        let pp = cpu(&every_other(prompt, 0))?;
        let refs = match reference {
            Some(r) => Some((cpu(&every_other(r, 0))?, cpu(&every_other(r, 1))?)),
            None => None,
        };
        let (lc, lr) = (
            every_other(&l.completion_len, 0),
            every_other(&l.completion_len, 1),
        );
        let lp = every_other(&l.prompt_len, 0);
        let out = pair_loss(
            obj,
            &PairLogps {
                chosen: &pc,
                rejected: &pr,
                ref_chosen: refs.as_ref().map(|r| &r.0),
                ref_rejected: refs.as_ref().map(|r| &r.1),
                chosen_prompt: Some(&pp),
                chosen_len: &lc,
                rejected_len: &lr,
                prompt_len: &lp,
            },
        )?;
        let a = lc.len() as f64 / st.units.max(1.0);
        let (dc, dr) = (host(&out.d_chosen)?, host(&out.d_rejected)?);
        // ORPO's NLL is a token mean over the step; its odds-ratio part a mean over pairs.
        let (nll, d_nll, b) = match obj {
            PairObjective::Orpo { .. } => {
                let nll = out
                    .metrics
                    .iter()
                    .find(|m| m.0 == "nll_loss")
                    .map_or(0.0, |m| m.1);
                (
                    nll,
                    out.d_chosen_prompt,
                    nll_tokens(l) / st.nll_tokens.max(1.0),
                )
            }
            _ => (0.0, 0.0, 0.0),
        };
        let mut d_seq = Vec::with_capacity(2 * dc.len());
        for (c, r) in dc.iter().zip(&dr) {
            d_seq.push((c - d_nll) * a + d_nll * b);
            d_seq.push(r * a);
        }
        Ok(Share {
            loss: (out.loss - nll) * a + nll * b,
            d_seq,
            d_prompt: d_nll * b,
            metrics: out.metrics,
        })
    }

    /// A KTO micro-batch's share of the step.
    fn kto(
        &self,
        k: super::kto_loss::Kto,
        l: &PrefLayout,
        comp: &[f64],
        reference: &[f64],
        st: &StepState,
    ) -> Result<Share> {
        let (p, r) = (cpu(comp)?, cpu(reference)?);
        let out = kto_loss(
            k,
            &KtoLogps {
                policy: &p,
                reference: &r,
                desirable: &l.desirable,
                kl: st.kl,
            },
        )?;
        let a = comp.len() as f64 / st.units.max(1.0);
        Ok(Share {
            loss: out.loss * a,
            d_seq: host(&out.d_policy)?.iter().map(|d| d * a).collect(),
            d_prompt: 0.0,
            metrics: out.metrics,
        })
    }
}

impl Objective for Pref {
    fn begin_step(&self, model: &Model, par: &Par, batches: &[Batch]) -> Result<()> {
        let kto = self.kind.is_kto();
        // [units, ORPO's NLL tokens, KTO's Σ (policy - reference) over its KL pairs, their count]
        let mut local = [0f64; 4];
        for b in batches {
            let l = layout(b)?;
            local[0] += match kto {
                true => l.n_seqs(),
                false => l.n_seqs() / 2,
            } as f64;
            local[1] += nll_tokens(l);
            if let (true, Some(kl)) = (kto, &l.kl) {
                let pol = host(&seq_logps(model, par, kl, None)?)?;
                let refs = match self.reference(model, par, kl)? {
                    Some(r) => host(&r)?,
                    None => bail!("KTO needs the reference's log-probabilities"),
                };
                local[2] += pol.iter().zip(&refs).map(|(a, b)| a - b).sum::<f64>();
                local[3] += pol.len() as f64;
            }
        }
        let all = match par.comm.world() {
            1 => local.to_vec(),
            _ => host(
                &par.comm
                    .all_reduce_sum(&Tensor::new(&local, &model.device)?)?,
            )?,
        };
        let mut st = self.state()?;
        *st = StepState {
            units: all[0],
            nll_tokens: all[1],
            kl: all[2] / all[3].max(1.0),
            metrics: Vec::new(),
        };
        Ok(())
    }

    fn reference(&self, model: &Model, par: &Par, batch: &Batch) -> Result<Option<Tensor>> {
        let stored = batch.pref.as_ref().and_then(|l| l.reference.as_ref());
        match (&self.weights, stored) {
            // `train.precompute_ref`: what this forward gave before the run (pref_store).
            (Some(_), Some(v)) => Ok(Some(Tensor::from_slice(v, v.len(), &model.device)?)),
            (Some(w), None) => Ok(Some(seq_logps(model, par, batch, Some(w))?)),
            (None, _) => Ok(None),
        }
    }

    fn head(&self, model: &Model, x: &Tensor, h: &HeadIn) -> Result<HeadOut> {
        let l = layout(h.batch)?;
        let Some(t) = h.targets else {
            bail!("a preference micro-batch with no completion token");
        };
        let chunk = head_chunk_rows(model.cfg.vocab_size, model.kernels.cross_entropy).max(1);
        let n_tgt = t.rows.dim(0)?;
        let (mut ce, mut dx) = (Vec::new(), Vec::new());
        for off in (0..n_tgt).step_by(chunk) {
            let len = chunk.min(n_tgt - off);
            let (r, tok) = (t.rows.narrow(0, off, len)?, t.tokens.narrow(0, off, len)?);
            // d(CE_row)/dx = -d(log p_row)/dx
            let (c, d) = model.head_ce_rows_bwd_dev(&x.index_select(&r, 0)?, &tok, 1.0)?;
            ce.push(c);
            dx.push(d);
        }
        let logp = Tensor::cat(&ce, 0)?.neg()?; // [n] f32
        let (comp, prompt) = l.seq_sums(&logp)?;
        let (comp, prompt) = (host(&comp)?, host(&prompt)?);
        let reference = h.reference.map(host).transpose()?;
        let mut st = self.state()?;
        let share = match self.kind {
            ObjectiveKind::Pair { loss, .. } => {
                self.pair(loss, l, &comp, &prompt, reference.as_deref(), &st)?
            }
            ObjectiveKind::Kto { loss, .. } => match &reference {
                Some(r) => self.kto(loss, l, &comp, r, &st)?,
                None => bail!("KTO needs the reference's log-probabilities"),
            },
            ObjectiveKind::Sft => bail!("the preference head was asked for SFT"),
        };
        for &(name, v) in &share.metrics {
            match st.metrics.iter_mut().find(|m| m.0 == name) {
                Some(m) => {
                    m.1 += v;
                    m.2 += 1.0;
                }
                None => st.metrics.push((name, v, 1.0)),
            }
        }
        drop(st);
        let dev = x.device();
        let d_seq: Vec<f32> = share.d_seq.iter().map(|&d| d as f32).collect();
        let d_seq = Tensor::from_vec(d_seq, l.n_seqs(), dev)?;
        // dL/d(log p) of each target, then dL/dx = -w · d(CE)/dx
        let w = l.target_weights(&d_seq, share.d_prompt)?.neg()?;
        let mut grad_rows = Vec::with_capacity(dx.len());
        let mut off = 0;
        for d in dx {
            let len = d.dim(0)?;
            let wc = w.narrow(0, off, len)?.to_dtype(d.dtype())?.unsqueeze(1)?;
            grad_rows.push(d.broadcast_mul(&wc)?);
            off += len;
        }
        // The engine divides the step's Σ by `denom`.
        let loss_sum = Tensor::new((share.loss * h.denom) as f32, dev)?;
        Ok(HeadOut {
            loss_sum: Some(loss_sum),
            grad_rows,
        })
    }

    fn end_step(&self, comm: &dyn Comm, model: &Model) -> Result<Vec<Metric>> {
        let got = std::mem::take(&mut self.state()?.metrics);
        let names = metric_names(self.kind);
        let mut v = vec![0f64; 2 * names.len()];
        for (name, s, c) in got {
            if let Some(i) = names.iter().position(|n| *n == name) {
                v[i] += s;
                v[names.len() + i] += c;
            }
        }
        if comm.world() > 1 {
            v = host(&comm.all_reduce_sum(&Tensor::new(v.as_slice(), &model.device)?)?)?;
        }
        Ok(names
            .iter()
            .enumerate()
            .filter(|&(i, _)| v[names.len() + i] > 0.0)
            .map(|(i, &n)| (n, v[i] / v[names.len() + i]))
            .collect())
    }
}
