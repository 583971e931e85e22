//! The layer-wise forward/backward driver: the home of activation checkpointing (and, later,
//! FSDP gathers and DDP buckets).
//!
//! Forward runs the decoder one layer at a time, each layer keeping what its hand-written
//! backward needs (`Layer::forward_train`, model/layer_train.rs); backward runs one layer at a
//! time too: given dL/d(output), `Layer::backward` returns dL/d(input) for the layer below and
//! the layer's LoRA gradients. No autograd graph is built at all (`Model::head_loss_bwd` does
//! the head's).
//!
//! With activation checkpointing, forward keeps only each layer's input [B, T, C]; backward
//! recomputes the layer from it (dropout masks are keyed, so identical).

use super::optim::Grads;
use crate::data::Batch;
use crate::model::{Ctx, LayerActs, LayerGrads, Model};
use candle_core::{Result, Tensor};

/// What forward leaves behind for one layer.
enum Saved {
    /// Checkpointed: the layer input only.
    Input(Tensor),
    /// Kept: what the layer's backward needs.
    Acts(LayerActs),
}

/// Runs one micro-batch forward and backward; adds its adapter gradients into `grads`.
/// The loss is Σ token CE / `denom` (denom = counted tokens of the whole accumulated batch,
/// so micro-batches of different sizes weigh as one big batch would). Returns Σ token CE.
pub fn forward_backward(
    model: &Model,
    batch: &Batch,
    denom: f64,
    checkpointing: bool,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
) -> Result<f64> {
    forward_backward_probed(
        model,
        batch,
        denom,
        checkpointing,
        dropout,
        grads,
        None,
        &mut |_| Ok(()),
    )
}

/// `forward_backward`, calling `probe(phase)` as each phase ends ("forward", "head",
/// "backward"): the memory reports read and reset the device's peak there. `head_chunk`:
/// counted positions per lm_head + loss chunk (None: ~2^24 logits at a time).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_probed(
    model: &Model,
    batch: &Batch,
    denom: f64,
    checkpointing: bool,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
    head_chunk: Option<usize>,
    probe: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<f64> {
    let dev = &model.device;
    let (b, t) = (batch.b, batch.t);
    let ids = Tensor::from_slice(&batch.ids, (b, t), dev)?;
    let ctx = model.ctx(&batch.positions, b, t, batch.segments.clone(), dropout)?;

    // ---- forward, layer by layer
    let mut x = model.embed(&ids)?; // [B, T, C], no graph
    let mut saved = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let (y, acts) = layer.forward_train(&x, &ctx, !checkpointing)?;
        saved.push(match acts {
            Some(acts) => Saved::Acts(acts),
            None => Saved::Input(x),
        });
        x = y;
    }

    probe("forward")?;

    // ---- head + loss on the counted positions only
    if batch.targets.is_empty() {
        return Ok(0.0);
    }
    // The head runs over chunks of the counted positions, each chunk's forward and backward
    // before the next, so the f32 logits of only ~2^24 entries exist at a time
    // ([N × V] at once is 0.5 GB per 4k tokens at a 32k vocabulary, and CE keeps several).
    let c = model.cfg.hidden_size;
    let x = x.reshape((b * t, c))?;
    let chunk = head_chunk
        .unwrap_or((1usize << 24) / model.cfg.vocab_size.max(1))
        .max(1);
    let mut g = x.zeros_like()?; // dL/dh [B·T, C]
    let mut ce_value = 0f64;
    for part in batch.targets.chunks(chunk) {
        let rows: Vec<u32> = part.iter().map(|&(i, _)| i as u32).collect();
        let tgt: Vec<u32> = part.iter().map(|&(_, l)| l).collect();
        let rows = Tensor::from_vec(rows, part.len(), dev)?;
        let tgt = Tensor::from_vec(tgt, part.len(), dev)?;
        let (ce, gh) = model.head_loss_bwd(&x.index_select(&rows, 0)?, &tgt, denom)?;
        ce_value += ce;
        g = g.index_add(&rows, &gh, 0)?;
    }
    drop(x);
    let mut g = g.reshape((b, t, c))?;
    probe("head")?;

    // ---- backward, last layer first
    for (l, layer) in model.layers.iter().enumerate().rev() {
        let acts = match saved.pop() {
            Some(Saved::Acts(acts)) => acts,
            Some(Saved::Input(x)) => match layer.forward_train(&x, &ctx, true)? {
                (_, Some(acts)) => acts,
                (_, None) => candle_core::bail!("driver: layer {l} kept nothing to recompute from"),
            },
            None => candle_core::bail!("driver: no saved activations for layer {l}"),
        };
        let (dx, lg) = layer.backward(acts, &g, &ctx)?;
        accumulate(lg, grads)?;
        g = dx;
    }
    probe("backward")?;
    Ok(ce_value)
}

/// Adds a layer's adapter gradients (f32) into the running sums.
fn accumulate(lg: LayerGrads, grads: &mut Grads) -> Result<()> {
    for (id, g) in lg {
        let sum = match grads.remove(&id) {
            Some(prev) => (prev + g)?,
            None => g,
        };
        grads.insert(id, sum);
    }
    Ok(())
}

/// Forward only, for logits-level checks: the model's `forward` with a batch's context.
pub fn logits(model: &Model, batch: &Batch) -> Result<Tensor> {
    let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &model.device)?;
    let ctx: Ctx = model.ctx(
        &batch.positions,
        batch.b,
        batch.t,
        batch.segments.clone(),
        None,
    )?;
    model.forward(&ids, &ctx)
}
