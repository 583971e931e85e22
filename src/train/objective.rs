//! The training objective: what a step asks of the head. The driver runs the decoder forward,
//! hands the last layer's output to the objective, and runs the decoder backward from the
//! gradient it returns; the objective alone knows the loss. SFT's cross-entropy is `Sft`; the
//! preference objectives (DPO, ORPO, SimPO, KTO) are `super::pref_objective::Pref`, which also
//! runs the reference's forward before the policy's (`Objective::reference`) and a step-wide
//! pass first (`Objective::begin_step`: the step's pair count, KTO's KL estimate), without
//! touching the driver's layer loop or the layers.
//!
//! Shapes: N positions of the micro-batch (B·T), C hidden, V vocab, n counted positions.

use super::comm::Comm;
use super::driver::Par;
use super::kto_loss::Kto;
use super::pref_loss::{DpoLoss, Metric, PairObjective};
use super::pref_ref::RefWeights;
use super::sizes::head_chunk_rows;
use crate::data::Batch;
use crate::model::Model;
use crate::recipe::{PrefLoss, PrefReference, Recipe, TrainObjective, PREF_BETA};
use candle_core::{Result, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::Arc;

/// What DPO and KTO score the policy against (`train.pref_reference`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Reference {
    /// The base, the adapters off.
    #[default]
    Base,
    /// The adapter the run started from (`lora.init_adapter`).
    InitAdapter,
}

/// Which objective a run trains (`RunConfig::objective`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) enum ObjectiveKind {
    /// Causal-LM cross-entropy over the counted tokens (supervised fine-tuning).
    #[default]
    Sft,
    /// DPO, ORPO or SimPO on pairs (DPO against `reference`).
    Pair {
        /// The loss and its settings.
        loss: PairObjective,
        /// DPO's reference.
        reference: Reference,
    },
    /// KTO on unpaired examples, against `reference`.
    Kto {
        /// KTO's settings.
        loss: Kto,
        /// The reference.
        reference: Reference,
    },
}

impl ObjectiveKind {
    /// The recipe's `train.objective` and its settings, resolved.
    pub(crate) fn of(r: &Recipe) -> ObjectiveKind {
        let t = &r.train;
        let beta = t.pref_beta.unwrap_or(PREF_BETA);
        let reference = match t.pref_reference {
            PrefReference::Base => Reference::Base,
            PrefReference::InitAdapter => Reference::InitAdapter,
        };
        let pair = |loss| ObjectiveKind::Pair { loss, reference };
        match t.objective {
            TrainObjective::Sft => ObjectiveKind::Sft,
            TrainObjective::Dpo => pair(PairObjective::Dpo {
                beta,
                loss: match t.pref_loss {
                    PrefLoss::Sigmoid => DpoLoss::Sigmoid,
                    PrefLoss::Ipo => DpoLoss::Ipo,
                    PrefLoss::Hinge => DpoLoss::Hinge,
                },
            }),
            TrainObjective::Orpo => pair(PairObjective::Orpo { beta }),
            TrainObjective::Simpo => pair(PairObjective::Simpo {
                beta,
                gamma: t.simpo_gamma,
                cpo_alpha: t.cpo_alpha,
            }),
            TrainObjective::Kto => ObjectiveKind::Kto {
                loss: Kto {
                    beta,
                    desirable_weight: t.kto_desirable_weight,
                    undesirable_weight: t.kto_undesirable_weight,
                },
                reference,
            },
        }
    }

    /// Whether the data are preference rows (pairs or KTO's unpaired examples).
    pub(crate) fn is_pref(self) -> bool {
        self != ObjectiveKind::Sft
    }

    /// Tokens a row of a micro-batch holds at most when each sequence keeps `seq_len`: a pair's
    /// prefix tree (DPO, ORPO, SimPO: its prompt once, p ≥ 1 tokens, and its two completions of
    /// up to seq_len − p each: 2 · seq_len − 1 at p = 1; `data::pref_batch`), else seq_len.
    pub(crate) fn row_tokens(self, seq_len: usize) -> usize {
        match self {
            ObjectiveKind::Pair { .. } => (2 * seq_len).saturating_sub(1).max(seq_len),
            _ => seq_len,
        }
    }

    /// KTO's unpaired examples (else pairs).
    pub(crate) fn is_kto(self) -> bool {
        matches!(self, ObjectiveKind::Kto { .. })
    }

    /// ORPO: the chosen prompts are scored too (its NLL).
    pub(crate) fn scores_chosen_prompt(self) -> bool {
        matches!(
            self,
            ObjectiveKind::Pair {
                loss: PairObjective::Orpo { .. },
                ..
            }
        )
    }

    /// The reference model it scores against: None without one (SFT, ORPO, SimPO).
    pub(crate) fn reference(self) -> Option<Reference> {
        match self {
            ObjectiveKind::Pair {
                loss: PairObjective::Dpo { .. },
                reference,
            }
            | ObjectiveKind::Kto { reference, .. } => Some(reference),
            _ => None,
        }
    }

    /// The values its reference puts in place of the adapters (None without a reference);
    /// `init`: the init adapter's values, for `Reference::InitAdapter`.
    pub(crate) fn ref_weights(
        self,
        init: Option<Arc<HashMap<TensorId, Tensor>>>,
    ) -> Option<RefWeights> {
        match (self.reference(), init) {
            (Some(Reference::InitAdapter), Some(init)) => Some(RefWeights::Init(init)),
            (Some(_), _) => Some(RefWeights::Base),
            (None, _) => None,
        }
    }

    /// The objective itself; `init`: the init adapter's values (`pref_ref::snapshot`), for
    /// `Reference::InitAdapter`.
    pub(crate) fn objective(
        self,
        init: Option<Arc<HashMap<TensorId, Tensor>>>,
    ) -> Box<dyn Objective> {
        let weights = self.ref_weights(init);
        match self {
            ObjectiveKind::Sft => Box::new(Sft::default()),
            kind => Box::new(super::pref_objective::Pref::new(kind, weights)),
        }
    }
}

/// The counted positions of a micro-batch, on the device: each position's row in [N, C], and
/// the token it predicts.
pub struct Targets {
    /// [n] u32: rows of x.
    pub(crate) rows: Tensor,
    /// [n] u32: the token each row predicts.
    pub(crate) tokens: Tensor,
}

/// What the head gives the backward.
pub struct HeadOut {
    /// The step's loss numerator of this micro-batch, on the device (a scalar f32; None:
    /// nothing counted): the step's loss is the sum over micro-batches and ranks / `denom`.
    pub(crate) loss_sum: Option<Tensor>,
    /// dL/dh of the counted rows, [n_i, C] per chunk, in `Targets::rows` order.
    pub(crate) grad_rows: Vec<Tensor>,
}

/// What the head of one micro-batch is given besides the hidden states.
pub struct HeadIn<'a> {
    /// The counted positions (None: nothing counted).
    pub(crate) targets: Option<&'a Targets>,
    /// The step's loss denominator over every micro-batch and rank, so that the gradients of
    /// the micro-batches and ranks add up to the step's.
    pub(crate) denom: f64,
    /// The micro-batch (a preference objective reads its layout, `Batch::pref`).
    pub(crate) batch: &'a Batch,
    /// What `Objective::reference` gave for this micro-batch.
    pub(crate) reference: Option<&'a Tensor>,
}

/// A training objective at the head.
pub trait Objective: Send + Sync {
    /// Before a step's micro-batches (this rank's `batches`), on every rank: what the head of
    /// each needs from the whole step (over every rank). SFT: nothing.
    fn begin_step(&self, _model: &Model, _par: &Par, _batches: &[Batch]) -> Result<()> {
        Ok(())
    }

    /// Before a micro-batch's policy forward: the reference's per-sequence log-probabilities,
    /// when the objective has a reference.
    fn reference(&self, _model: &Model, _par: &Par, _batch: &Batch) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The head and the loss over the counted positions of `x` [N, C] (the final hidden
    /// states, before the norm), forward and backward: the loss's numerator and dL/dx of the
    /// counted rows.
    fn head(&self, model: &Model, x: &Tensor, h: &HeadIn) -> Result<HeadOut>;

    /// After a step's micro-batches: its metrics beside the loss (TRL's names), averaged over
    /// its micro-batches and every rank. SFT: none.
    fn end_step(&self, _comm: &dyn Comm, _model: &Model) -> Result<Vec<Metric>> {
        Ok(Vec::new())
    }
}

/// Supervised fine-tuning: Σ token cross-entropy over the counted positions / `denom`, the
/// head run over chunks of the counted positions, each chunk's forward and backward before
/// the next, so the logits of only ~2^24 entries exist at a time ([N × V] at once is 0.25 GB
/// per 4k tokens in bf16 at a 32k vocabulary; the CPU's f32 CE keeps several).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sft {
    /// Counted positions per lm_head + loss chunk (None: `train::sizes::head_chunk_rows`).
    pub head_chunk: Option<usize>,
}

impl Objective for Sft {
    fn head(&self, model: &Model, x: &Tensor, h: &HeadIn) -> Result<HeadOut> {
        let (targets, denom) = (h.targets, h.denom);
        let chunk = self
            .head_chunk
            .unwrap_or_else(|| head_chunk_rows(model.cfg.vocab_size, model.kernels.cross_entropy))
            .max(1);
        let mut loss_sum: Option<Tensor> = None;
        let mut grad_rows = Vec::new(); // each chunk's dL/dh rows [n_chunk, C]
        if let Some(t) = targets {
            let n_tgt = t.rows.dim(0)?;
            for off in (0..n_tgt).step_by(chunk) {
                let len = chunk.min(n_tgt - off);
                let (r, tok) = (t.rows.narrow(0, off, len)?, t.tokens.narrow(0, off, len)?);
                let (ce, gh) = model.head_loss_bwd_dev(&x.index_select(&r, 0)?, &tok, denom)?;
                loss_sum = Some(match loss_sum {
                    Some(s) => (s + ce)?,
                    None => ce,
                });
                grad_rows.push(gh);
            }
        }
        Ok(HeadOut {
            loss_sum,
            grad_rows,
        })
    }
}
