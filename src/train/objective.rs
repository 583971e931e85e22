//! The training objective: what a step asks of the head. The driver runs the decoder forward,
//! hands the last layer's output to the objective, and runs the decoder backward from the
//! gradient it returns; the objective alone knows the loss. Today's is the SFT cross-entropy
//! (`Sft`); a preference objective (DPO and its kin) plugs in here without touching the driver
//! or the layers.
//!
//! Shapes: N positions of the micro-batch (B·T), C hidden, V vocab, n counted positions.

use crate::memory::sizes::head_chunk_rows;
use crate::model::Model;
use candle_core::{Result, Tensor};

/// Which objective a run trains (`RunConfig::objective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ObjectiveKind {
    /// Causal-LM cross-entropy over the counted tokens (supervised fine-tuning).
    #[default]
    Sft,
}

impl ObjectiveKind {
    /// The objective itself.
    pub(crate) fn objective(self) -> Box<dyn Objective> {
        match self {
            ObjectiveKind::Sft => Box::new(Sft::default()),
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

/// A training objective at the head.
pub trait Objective: Send + Sync {
    /// The head and the loss over the counted positions `targets` of `x` [N, C] (the final
    /// hidden states, before the norm), forward and backward: the loss's numerator and dL/dx
    /// of the counted rows. `denom`: the step's loss denominator over every micro-batch and
    /// rank, so that the gradients of the micro-batches and ranks add up to the step's.
    fn head(
        &self,
        model: &Model,
        x: &Tensor,
        targets: Option<&Targets>,
        denom: f64,
    ) -> Result<HeadOut>;
}

/// Supervised fine-tuning: Σ token cross-entropy over the counted positions / `denom`, the
/// head run over chunks of the counted positions, each chunk's forward and backward before
/// the next, so the logits of only ~2^24 entries exist at a time ([N × V] at once is 0.25 GB
/// per 4k tokens in bf16 at a 32k vocabulary; the CPU's f32 CE keeps several).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sft {
    /// Counted positions per lm_head + loss chunk (None: `memory::sizes::head_chunk_rows`).
    pub head_chunk: Option<usize>,
}

impl Objective for Sft {
    fn head(
        &self,
        model: &Model,
        x: &Tensor,
        targets: Option<&Targets>,
        denom: f64,
    ) -> Result<HeadOut> {
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
