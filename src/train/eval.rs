//! Eval loss: token cross-entropy over a batch, forward only.
//!
//! Each layer runs the step engine's forward (`Layer::forward_train` without its activations:
//! the fused kernels and folded GEMMs training uses, no graph recorded), so at most one layer's
//! transients are alive at once and eval costs what its FLOPs say.

use super::driver::Par;
use crate::data::Batch;
use crate::model::decoder::cross_entropy_sum;
use crate::model::Model;
use candle_core::{Result, Tensor};

/// Target rows through the head at a time: logits are [rows, V] f32 (V = 128k: 0.5 GB).
const HEAD_CHUNK: usize = 1024;

/// Σ token CE over the batch's counted tokens (no dropout); divide by `batch.n_targets()`.
pub fn ce_sum(model: &Model, batch: &Batch) -> Result<f64> {
    ce_sum_par(model, &Par::single(), batch)
}

/// `ce_sum` with the frozen base gathered layer by layer under FSDP. Every rank evaluates the
/// same batches, so the gathers match.
pub(crate) fn ce_sum_par(model: &Model, par: &Par, batch: &Batch) -> Result<f64> {
    if batch.targets.is_empty() {
        return Ok(0.0);
    }
    let dev = &model.device;
    let (b, t) = (batch.b, batch.t);
    let ids = Tensor::from_slice(&batch.ids, (b, t), dev)?;
    let ctx = super::driver::batch_ctx(model, batch, None)?;
    let mut x = match par.io(model)? {
        Some(io) => io.embed(&ids)?,
        None => model.embed(&ids)?,
    }; // [B, T, C]
    for l in 0..model.layers.len() {
        x = par.layer(model, l)?.forward_train(&x, &ctx, false)?.0;
    }
    let io = par.io(model)?;
    let model_io = io.as_ref().unwrap_or(model);
    let h = x.reshape((b * t, model.cfg.hidden_size))?; // [B·T, C]
    let mut sum = 0.0;
    for chunk in batch.targets.chunks(HEAD_CHUNK) {
        let rows: Vec<u32> = chunk.iter().map(|&(i, _)| i as u32).collect();
        let tgt: Vec<u32> = chunk.iter().map(|&(_, l)| l).collect();
        let rows = Tensor::from_vec(rows, chunk.len(), dev)?;
        let tgt = Tensor::from_vec(tgt, chunk.len(), dev)?;
        let logits = model_io.head(&h.index_select(&rows, 0)?)?.detach(); // [N, V] f32
        sum += cross_entropy_sum(&logits, &tgt)?.to_scalar::<f32>()? as f64;
    }
    Ok(sum)
}
