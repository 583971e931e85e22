//! The forwards a preference objective runs besides the policy's: the reference's (the same
//! model with its adapters off, or with the init adapter's values in their place) and KTO's
//! policy forward over its mismatched pairs, each keeping no activations and no graph, giving
//! the log-probability of every target token.
//!
//! The reference is a `Ctx` whose adapter copies (`Ctx::adapters`, by Var id) are the
//! reference's: "base" maps every B to zeros (y = W x + s · (x Aᵀ) 0ᵀ = W x exactly),
//! "init_adapter" maps every A and B to the init adapter's values. The layers are untouched.

use super::driver::Par;
use super::sizes::head_chunk_rows;
use crate::data::Batch;
use crate::model::{Ctx, Model, Retain};
use candle_core::{DType, Device, Result, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::Arc;

/// The values the reference puts in place of the adapters.
#[derive(Clone)]
pub enum RefWeights {
    /// The base: every B zero.
    Base,
    /// The init adapter's A's and B's (and DoRA's m), by the Var id they replace.
    Init(Arc<HashMap<TensorId, Tensor>>),
}

/// A copy of every adapter tensor of `model` as it is now (right after the init adapter is
/// loaded: the reference of `train.pref_reference = "init_adapter"`).
pub fn snapshot(model: &Model) -> Result<Arc<HashMap<TensorId, Tensor>>> {
    let mut m = HashMap::new();
    for (_, l) in model.adapters() {
        for v in l.vars() {
            m.insert(v.id(), v.as_tensor().copy()?);
        }
    }
    Ok(Arc::new(m))
}

/// `ctx` made the reference's: its adapter copies replaced by `w`'s, nothing folded, no
/// dropout.
pub fn reference_ctx(model: &Model, mut ctx: Ctx, w: &RefWeights) -> Result<Ctx> {
    let mut map = HashMap::new();
    for (_, l) in model.adapters() {
        for v in l.vars() {
            let dt = ctx.adapter(v).dtype();
            let t = match w {
                RefWeights::Base if v.id() == l.b.id() => v.zeros_like()?.to_dtype(dt)?,
                RefWeights::Base => ctx.adapter(v).clone(),
                RefWeights::Init(init) => match init.get(&v.id()) {
                    Some(t) => t.to_dtype(dt)?,
                    None => {
                        candle_core::bail!("pref_ref: the init adapter lacks an adapter tensor")
                    }
                },
            };
            map.insert(v.id(), t);
        }
    }
    ctx.adapters = map;
    ctx.adapter_buf = None;
    ctx.folded = false;
    ctx.dropout = None;
    Ok(ctx)
}

/// The micro-batch's context without dropout (KTO's policy forward over its mismatched
/// pairs), and with `w` in place of the adapters when given (the reference).
pub fn ctx_of(model: &Model, batch: &Batch, w: Option<&RefWeights>) -> Result<Ctx> {
    let ctx = super::driver::batch_ctx(model, batch, None)?;
    match w {
        Some(w) => reference_ctx(model, ctx, w),
        None => {
            let mut ctx = ctx;
            ctx.folded = false;
            Ok(ctx)
        }
    }
}

/// log p of every target of `batch` [n_targets] f32 under `ctx`: the decoder forward one layer
/// at a time keeping nothing (each layer gathered under FSDP), then the head over the target
/// rows in chunks.
pub fn target_logps(model: &Model, par: &Par, batch: &Batch, ctx: &Ctx) -> Result<Tensor> {
    let dev = &model.device;
    let (b, t) = (batch.b, batch.t);
    let ids = Tensor::from_slice(&batch.ids, (b, t), dev)?;
    let io = par.io(model)?;
    let head = io.as_ref().unwrap_or(model);
    let mut x = head.embed(&ids)?;
    for l in 0..model.layers.len() {
        let layer = par.layer(model, l)?;
        x = layer.forward_retain(&x, ctx, Retain::Nothing)?.0;
    }
    let c = model.cfg.hidden_size;
    let x = x.reshape((b * t, c))?;
    head_logps(head, &x, batch, dev)
}

/// log p of each target from the final hidden rows x [B·T, C] (no backward), in chunks of
/// ~2^24 logits, by the policy head's own cross-entropy kernel (so equal weights give equal
/// bits).
fn head_logps(model: &Model, x: &Tensor, batch: &Batch, dev: &Device) -> Result<Tensor> {
    let n = batch.targets.len();
    if n == 0 {
        return Tensor::zeros(0, DType::F32, dev);
    }
    let rows: Vec<u32> = batch.targets.iter().map(|&(i, _)| i as u32).collect();
    let toks: Vec<u32> = batch.targets.iter().map(|&(_, t)| t).collect();
    let rows = Tensor::from_vec(rows, n, dev)?;
    let toks = Tensor::from_vec(toks, n, dev)?;
    let chunk = head_chunk_rows(model.cfg.vocab_size, model.kernels.cross_entropy).max(1);
    let mut parts = Vec::new();
    for off in (0..n).step_by(chunk) {
        let len = chunk.min(n - off);
        let h = x.index_select(&rows.narrow(0, off, len)?, 0)?;
        parts.push(
            model
                .head_ce_rows_dev(&h, &toks.narrow(0, off, len)?)?
                .neg()?,
        );
    }
    Tensor::cat(&parts, 0)
}

/// The per-sequence sums of the completion targets' log-probabilities of a preference batch
/// under `w` (the reference) or the policy (None), [n_seqs] f32.
pub fn seq_logps(
    model: &Model,
    par: &Par,
    batch: &Batch,
    w: Option<&RefWeights>,
) -> Result<Tensor> {
    let Some(layout) = &batch.pref else {
        candle_core::bail!("pref_ref: a batch without its preference layout");
    };
    let ctx = ctx_of(model, batch, w)?;
    let lp = target_logps(model, par, batch, &ctx)?;
    Ok(layout.seq_sums(&lp)?.0)
}
